"""`zeroshard generate` and `zeroshard convert` on what Hugging Face writes (issue 29.7).

The folders are built here from a tiny transformers GPT-2 (no download): a
``save_pretrained`` folder, a sharded one (``max_shard_size``), a Trainer checkpoint
folder as transformers 5.24's ``Trainer._save_checkpoint`` lays it out (config.json,
generation_config.json, model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json, training_args.bin; the pickles are stand-ins, never read), and the
same folder as a Trainer under zeroshard (``--as-deepspeed``) writes it, with ``latest``
and a zeroshard checkpoint ``global_step2`` beside the Hugging Face files. The tokenizer
is a byte-level BPE over 256 symbols built with ``tokenizers``.

Each source generates the tokens the original model generates; each missing piece
(tokenizer, config, weights) and each wrong input (a JSON file, pickles only, an empty
folder) ends with exit status 2 and one line naming it, whose ``--options`` all exist.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil

import multirank
import pytest
import torch

transformers = pytest.importorskip("transformers")

from zeroshard.inference import init_inference  # noqa: E402
from zeroshard.tools.cli import main  # noqa: E402

PROMPT = "def f("
TRAINER_PICKLES = ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")


def _model():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)


def _trainer_files(folder: str, step: int) -> None:
    for name in TRAINER_PICKLES:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"\x80\x04pickle stand-in")
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": step, "log_history": []}, f)


def _zeroshard_save(rank: int, world: int, folder: str) -> None:
    import zeroshard

    model = _model()
    config = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.0}}}
    engine, *_ = zeroshard.initialize(model=model, model_parameters=model.parameters(), config=config)  # fmt: skip
    engine.save_checkpoint(folder, tag="global_step2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("hf")
    model = _model()
    paths = {name: str(root / name) for name in ("save", "sharded", "trainer", "zs_trainer")}
    model.save_pretrained(paths["save"])
    model.save_pretrained(paths["sharded"], max_shard_size="100KB")
    out = root / "out"  # a Trainer's output_dir: the tokenizer at the top, checkpoints below
    paths["trainer"] = str(out / "checkpoint-2")
    model.save_pretrained(paths["trainer"])
    _trainer_files(paths["trainer"], 2)
    _tokenizer(str(out))
    paths["tokenizer"] = str(out)
    multirank.run(_zeroshard_save, 1, paths["zs_trainer"], timeout=180)
    model.save_pretrained(paths["zs_trainer"])
    _trainer_files(paths["zs_trainer"], 2)
    paths["root"] = str(root)
    return paths


def _generate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", "--prompt", PROMPT, "--max-new-tokens", "6", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _expected(tokenizer: str) -> str:
    """The prompt and the original model's greedy tokens, through the same tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    ids = tok(PROMPT)["input_ids"]
    out = init_inference(_model()).generate([ids], max_new_tokens=6)[0].tolist()
    return tok.decode(out[: len(ids)], skip_special_tokens=True) + tok.decode(
        out[len(ids) :], skip_special_tokens=True
    )


def _options(command: str) -> set[str]:
    from zeroshard.tools.cli import SUBCOMMANDS

    module = __import__(SUBCOMMANDS[command][0], fromlist=["add_arguments"])
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return {s for a in parser._actions for s in a.option_strings}


def _one_line_naming(command: str, err: str, *fragments: str) -> None:
    """One line, ``zeroshard COMMAND: ...``, with each fragment, and no option that the
    command does not have (the old hint said "pass tag=" to `convert`)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zeroshard {command}: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "tag=" not in lines[0], lines[0]
    named = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", lines[0]))
    assert named <= _options(command), (named - _options(command), lines[0])


def test_generate_from_hugging_face_folders(folders, capsys) -> None:
    expected = _expected(folders["tokenizer"])
    for name in ("save", "sharded", "trainer", "zs_trainer"):
        code, out, err = _generate(capsys, "--checkpoint", folders[name], "--tokenizer", folders["tokenizer"])  # fmt: skip
        assert code == 0, (name, err)
        assert out.splitlines()[0] == expected, (name, out)


def test_generate_names_the_missing_tokenizer(folders, capsys) -> None:
    for name in ("save", "zs_trainer"):  # the checkpoint-12: a raw traceback before
        code, _, err = _generate(capsys, "--checkpoint", folders[name])
        assert code == 2
        _one_line_naming("generate", err, folders[name], "no tokenizer files", "--tokenizer")
    # a Trainer checkpoint-N: its output_dir above holds the tokenizer, and the hint says so
    code, _, err = _generate(capsys, "--checkpoint", folders["trainer"])
    assert code == 2
    _one_line_naming("generate", err, f"--tokenizer {folders['tokenizer']}")
    code, _, err = _generate(capsys, "--checkpoint", folders["save"], "--tokenizer", folders["save"])  # fmt: skip
    assert code == 2
    _one_line_naming("generate", err, "no tokenizer files")


def test_generate_and_convert_name_what_a_path_lacks(folders, capsys, tmp_path) -> None:
    root = tmp_path
    (root / "no_config").mkdir()
    shutil.copy(os.path.join(folders["save"], "model.safetensors"), root / "no_config")
    (root / "config_only").mkdir()
    shutil.copy(os.path.join(folders["save"], "config.json"), root / "config_only")
    (root / "pickles").mkdir()
    torch.save({}, root / "pickles" / "pytorch_model.bin")
    (root / "empty").mkdir()
    ds_config = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "ds_config_demo.json")  # fmt: skip
    cases = [
        (str(root / "no_config"), ("no model config", "no config.json")),
        (str(root / "config_only"), ("has config.json but no weights", "model.safetensors")),
        (str(root / "pickles"), ("pytorch_model.bin", "never loaded")),
        (str(root / "empty"), ("has no weights", "holds nothing")),
        (ds_config, ("a JSON file, not weights",)),
        (str(root / "nowhere"), ("no such file or directory",)),
    ]
    for path, fragments in cases:
        code, _, err = _generate(capsys, "--checkpoint", path, "--tokenizer", folders["tokenizer"])  # fmt: skip
        assert code == 2, path
        _one_line_naming("generate", err, path, *fragments)
        if "no model config" in fragments:
            continue  # convert copies weights; a config is not needed for that
        code = main(["convert", path, str(root / "out.safetensors")])
        out = capsys.readouterr().out  # convert prints its error on stdout, as before
        assert code == 2, path
        _one_line_naming("convert", out, path, *fragments)
    assert not (root / "out.safetensors").exists()


def test_convert_hugging_face_folders(folders, capsys, tmp_path) -> None:
    model = _model()
    ids = torch.tensor([[1, 2, 3, 4]])
    for name in ("sharded", "trainer"):
        out = str(tmp_path / name)
        assert main(["convert", folders[name], out, "--dtype", "bf16", "--max-shard-size", "150KB"]) == 0  # fmt: skip
        written = capsys.readouterr().out.split()
        assert "config.json" in map(os.path.basename, written)
        assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        with torch.no_grad():
            err = (back(ids).logits - model(ids).logits).abs().max().item()
        assert 0 < err < 0.1, err  # the bf16 round-trip, not the model itself
    # the zeroshard checkpoint inside a Trainer checkpoint, and --tag naming it
    for argv in (["convert", folders["zs_trainer"]], ["convert", folders["zs_trainer"], "--tag", "global_step2"]):  # fmt: skip
        out = str(tmp_path / f"zs{len(argv)}.safetensors")
        assert main([*argv[:2], out, *argv[2:]]) == 0
        capsys.readouterr()
        from safetensors.torch import load_file

        state = load_file(out)
        assert torch.equal(state["transformer.wte.weight"], model.transformer.wte.weight)
