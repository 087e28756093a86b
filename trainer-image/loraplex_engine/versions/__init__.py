"""Published adapter versions of continual experiments: when to publish and promote
(pure; the spec's ``publish`` block is spec/publish.py), the engine's publisher, and the
model names that address a version (``<ns>.<name>@v<N>``, ``<ns>.<name>:<alias>``). The
files are store/versions.py's."""
