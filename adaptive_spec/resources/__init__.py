"""Data files shipped with the package: policy presets and committed latency profiles.

In a checkout these are links to the top-level `policies/` and `profiles/` folders; a built wheel
holds copies. Read them with `importlib.resources.files(__name__)`."""

from importlib import resources
from pathlib import Path


def data_dir(name: str) -> Path:
    """The shipped folder `name` ("policies" or "profiles") as a filesystem path."""
    return Path(str(resources.files(__name__).joinpath(name)))
