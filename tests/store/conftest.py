"""The store tier's shared fixture: workers over a real store (tests/worker_kit.py). Here, not in
tests/conftest.py: importing it imports vLLM's KV transfer modules (about 10 s), which every
pytest process would otherwise pay at start, whatever tier it runs."""

from tests.worker_kit import make_worker_on  # noqa: F401 - shared fixture
