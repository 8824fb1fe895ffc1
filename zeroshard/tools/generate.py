"""`zeroshard generate --checkpoint PATH --prompt TEXT`: text from a saved model.

PATH is a zeroshard checkpoint (it records the model's config), a safetensors export
(``zeroshard convert``), a quantized file (``engine.save_quantized``), or a Hugging Face
folder: ``save_pretrained`` / ``Trainer.save_model`` output or a Trainer's
``checkpoint-N`` (``config.json`` beside ``model.safetensors`` or its sharded index;
``zeroshard/checkpoint/sources.py`` says what is read). The built-in GPT reads and
writes bytes (its vocabulary is 256 byte values); a Hugging Face model needs a tokenizer
(``--tokenizer``, default: PATH itself), checked before the model is built. What is
missing (weights, a config, a tokenizer) is named in one line. ``--quant int8|int4`` quantizes the
weights first. ``--nproc N`` starts N processes through ``zeroshard run`` that generate
together with tensor parallelism (tp_size N); rank 0 prints. ``--offload cpu|nvme``
(ZeRO-Inference) builds the model with empty parameters and streams its weights from a
safetensors export layer by layer. Exit status 2 on bad input (no model config, a group
size that does not divide, ...), naming it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    a = parser.add_argument
    a("--checkpoint", required=True, help="checkpoint directory, safetensors file or directory")
    a("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    a("--max-new-tokens", type=int, default=64)
    a("--quant", choices=["int8", "int4"], help="quantize the Linear layers' weights")
    a("--group-size", type=int, default=128, help="int4 group size (32, 64, 128, 256)")
    a("--asymmetric", action="store_true", help="scales and offsets (default: symmetric)")
    a("--dtype", choices=["fp32", "bf16", "fp16"], help="compute dtype (default: the model's)")
    a("--sample", action="store_true", help="sample (default: greedy)")
    a("--temperature", type=float, default=1.0)
    a("--top-k", type=int, default=0)
    a("--top-p", type=float, default=1.0)
    a("--seed", type=int, default=0)
    a("--stop", action="append", default=[], help="a stop token id (repeatable)")
    a("--tokenizer", help="Hugging Face tokenizer path (HF models; default: the checkpoint)")
    a("--nproc", type=int, default=1, help="processes for tensor-parallel generation")
    a("--no-cache", dest="use_cache", action="store_false", help="recompute every step")
    a("--offload", choices=["cpu", "nvme"], help="ZeRO-Inference: stream the weights from the "
      "safetensors export layer by layer, kept in CPU memory or NVMe files (--nvme-path)")  # fmt: skip
    a("--nvme-path", help="directory for the weight swap files (--offload nvme)")
    a("--buffer-count", type=int, default=5, help="layers held in RAM while streaming")


def _relaunch(args: argparse.Namespace) -> int:
    """``zeroshard run --nproc N`` this file with the same arguments (tp_size = N)."""
    argv = [a for a in sys.argv[1:] if a != "generate"]
    out, skip = [], False
    for a in argv:  # drop --nproc N / --nproc=N
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    cmd = [sys.executable, "-m", "zeroshard.tools.cli", "run", "--nproc", str(args.nproc),
           "-m", "zeroshard.tools.generate", *out]  # fmt: skip
    return subprocess.call(cmd)


def _config(args: argparse.Namespace, world: int) -> dict:
    cfg: dict = {"tensor_parallel": {"tp_size": world}}
    if args.quant:
        weight = {"num_bits": 8 if args.quant == "int8" else 4, "group_size": args.group_size}
        weight["q_type"] = "asymmetric" if args.asymmetric else "symmetric"
        cfg["quant"] = {"enabled": True, "weight": weight}
    if args.dtype:
        cfg["dtype"] = args.dtype
    if args.offload:
        off = {"device": args.offload, "buffer_count": args.buffer_count}
        if args.nvme_path:
            off["nvme_path"] = args.nvme_path
        cfg.update(checkpoint=args.checkpoint, zero={"stage": 3, "offload_param": off})
    return cfg


def _tokenizer(args: argparse.Namespace):
    """The Hugging Face tokenizer of ``--tokenizer`` (default: the checkpoint's folder);
    a ``ModelConfigError`` in one line when there is none or it does not load."""
    from zeroshard.checkpoint import sources
    from zeroshard.checkpoint.model_config import ModelConfigError

    source = args.tokenizer or args.checkpoint
    if os.path.exists(source):  # a local folder (else a hub name, left to transformers)
        folder = sources.tokenizer_folder(source)
        if folder is None:
            raise ModelConfigError(sources.no_tokenizer(source))
        source = folder
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:  # transformers raises OSError, ValueError, ImportError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError(f"{source}: its tokenizer does not load: {first}") from exc


def main(args: argparse.Namespace) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.nproc > 1 and world == 1:
        return _relaunch(args)
    import torch

    from zeroshard.checkpoint.model_config import GPT_CLASS, ModelConfigError
    from zeroshard.config.schema import ConfigError
    from zeroshard.inference import QuantizationError, init_inference
    from zeroshard.inference.weights import model_description, model_from
    from zeroshard.models import GPT

    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        torch.set_num_threads(1)
    try:
        # what the weights hold, then the tokenizer it needs, before anything is built
        described = model_description(args.checkpoint)
        tok = None if described.get("class") == GPT_CLASS else _tokenizer(args)
        if args.offload:  # parameters on meta: weights go file -> store one layer at a time
            from zeroshard.inference.stream_store import empty_model_from

            model = empty_model_from(args.checkpoint)
        else:
            model = model_from(args.checkpoint)
        engine = init_inference(model, _config(args, world))
    except (ModelConfigError, QuantizationError, ConfigError, OSError, ValueError) as exc:
        print(f"zeroshard generate: {exc}", file=sys.stderr)
        return 2
    if isinstance(model, GPT):
        prompts = [list(p.encode("utf-8")) for p in args.prompt]

        def decode(ids):
            return bytes(ids).decode("utf-8", errors="replace")
    else:
        assert tok is not None  # checked above for every model but the built-in GPT
        prompts = [tok(p)["input_ids"] for p in args.prompt]

        def decode(ids):
            return tok.decode(ids, skip_special_tokens=True)

    out = engine.generate(
        prompts,
        max_new_tokens=args.max_new_tokens,
        do_sample=args.sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=[int(s) for s in args.stop] or None,
        use_cache=args.use_cache,
    )
    if rank == 0:
        width = max(len(p) for p in prompts)
        for p, row in zip(prompts, out.tolist(), strict=True):
            new = row[width:]
            print(decode(p) + decode(new))
            print("-" * 40)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="zeroshard generate")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
