"""The Mooncake store as both sides see it: the client, its error codes and master outages
(`client`), the store keys and layout fingerprint (`keys`), and the KV cache groups a key and a
hit are made of (`groups`)."""
