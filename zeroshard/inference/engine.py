"""``zeroshard.init_inference(model, config)``: DeepSpeed's inference entry point.

The engine prepares the model once, in this order: weights loaded (``checkpoint``),
tensor parallelism (``tensor_parallel.tp_size`` > 1: ``tensor_parallel.py``), weight
quantization (``quant`` or ``dtype=torch.int8``), the compute dtype, then weight
streaming (``zero``: ``streaming.py``). It is callable (the model's forward, without
gradients) and has :meth:`InferenceEngine.generate`: Hugging Face models generate through
their own ``generate()`` (with the quantized layers in place), other models through
zeroshard's loop (``generate.py``; the built-in GPT with its KV cache, and with
``enable_cuda_graph`` or :meth:`InferenceEngine.compile` a static decode step captured
or compiled once and replayed per token: ``decode_graph.py``).

Collectives: none here; tensor-parallel layers issue theirs (see ``tensor_parallel.py``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from zeroshard.config.schema import ConfigError
from zeroshard.distributed.device import runtime
from zeroshard.inference.config import InferenceConfig, InferenceError, load_inference_config
from zeroshard.inference.generate import Sampling, generate_tokens, pad_prompts
from zeroshard.inference.quantize import QuantLinear, quantize_model, weight_bytes
from zeroshard.runtime.compiling import check_backend, compile_options

if TYPE_CHECKING:
    from zeroshard.inference.decode_graph import StaticDecoder
    from zeroshard.inference.kernels import KernelChoice
    from zeroshard.inference.streaming import StreamedWeights
    from zeroshard.inference.tensor_parallel import TPInference


log = logging.getLogger("zeroshard")


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "generate") and hasattr(model, "config") and hasattr(model, "can_generate")  # fmt: skip


def _has_cache_path(model: nn.Module) -> bool:
    from zeroshard.models import GPT

    return isinstance(model, GPT)


def cast_unquantized(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating parameters and buffers of every module but the quantized layers
    (ties stay ties: the parameter objects are kept)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            continue
        for p in module.parameters(recurse=False):
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in module.named_buffers(recurse=False):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                setattr(module, name, b.to(dtype))


class InferenceEngine:
    """What :func:`init_inference` returns: ``engine(*args)`` runs the model's forward,
    ``engine.generate(...)`` produces tokens, ``engine.module`` is the prepared model."""

    def __init__(self, model: nn.Module, config: InferenceConfig) -> None:
        self.config = config
        self.module = model
        self.tp: TPInference | None = None  # what tensor_parallel.py did, when tp_size > 1
        self.streaming: StreamedWeights | None = None  # streaming.py's, when config.zero is set
        # a model built on meta with zero: its weights go from the checkpoint to the
        # stream store one layer at a time (never whole in memory)
        self._stream_from_file = config.zero is not None and any(
            p.is_meta for p in model.parameters()
        )
        if self._stream_from_file:
            self._check_meta_model()
        elif config.checkpoint is not None:
            from zeroshard.inference.weights import load_weights

            load_weights(model, self._checkpoint_path())
        if config.tp_size > 1:
            self._apply_tensor_parallel()
        self.quantized: list[str] = []
        if config.num_bits is not None:
            self._quantize()
        if config.compute_dtype is not None:
            cast_unquantized(model, config.compute_dtype)
        #: the kernel measured fastest for each quantized layer shape (kernels.py; GPU only)
        self.kernel_choices: list[KernelChoice] = []
        self._pick_kernels(None)
        if config.zero is not None:
            self._apply_streaming()
        model.eval()
        #: the static decode step (decode_graph.py), one per batch size at a time
        self._decoder: StaticDecoder | None = None
        self._decode_compile: dict[str, Any] | None = None  # compile(): torch.compile's options
        if config.enable_cuda_graph:
            self._check_static_decode("enable_cuda_graph")
            if not runtime(self._device()).graphs:
                raise ConfigError(
                    "enable_cuda_graph",
                    f"the model is on {self._device()}, which has no device graphs to capture "
                    "(CUDA graphs need a CUDA device); leave it out, or call engine.compile() "
                    "to compile the decode step instead",
                )

    def _pick_kernels(self, compile_options: dict[str, Any] | None) -> None:
        """On a GPU, time the kernels each quantized layer shape can use and keep the
        fastest (``kernels.py``); on the CPU keep torch's CPU kernels."""
        if not self.quantized or self._device().type != "cuda" or self.config.zero is not None:
            return
        from zeroshard.inference.kernels import pick_kernels

        self.kernel_choices = pick_kernels(self.module, compile_options=compile_options)
        for choice in self.kernel_choices:
            log.info("zeroshard: quantized kernel %s", choice.row())

    # -- the static decode step (decode_graph.py) -----------------------------------------
    def _check_static_decode(self, what: str) -> None:
        """The captured or compiled decode step exists for the built-in GPT alone, on one
        rank's whole weights."""
        if not _has_cache_path(self.module):
            raise ConfigError(
                what,
                "the captured/compiled decode step is built for zeroshard's GPT only; a "
                "Hugging Face model has its own: generate(cache_implementation='static') "
                "with torch.compile (transformers' static cache)",
            )
        if self.tp is not None:
            raise ConfigError(
                what,
                "a captured/compiled decode step with tensor_parallel.tp_size > 1 is not "
                "built yet (the all-reduces inside the step); decode eagerly",
            )
        if self.config.zero is not None:
            raise ConfigError(
                what,
                "a captured/compiled decode step with weight streaming (zero) is not built "
                "yet (each step uploads the weights layer by layer from the host); decode "
                "eagerly",
            )

    def compile(
        self, backend: str | Callable | None = None, compile_kwargs: dict | None = None, **kw: Any
    ) -> None:
        """``torch.compile`` the one-token decode step of the built-in GPT (over a KV
        cache preallocated to ``max_out_tokens``, so dynamo compiles it once per batch
        size); with ``enable_cuda_graph`` the compiled step is captured in turn. The
        prompt stays eager. ``backend``/``compile_kwargs`` as for ``torch.compile``."""
        self._check_static_decode("compile")
        options = compile_options(backend, compile_kwargs, kw)
        check_backend(options.get("backend"))
        if self.config.enable_cuda_graph and options.get("mode") in ("reduce-overhead", "max-autotune"):  # fmt: skip
            raise ConfigError(
                "compile",
                f"mode={options['mode']!r} captures CUDA graphs itself; with enable_cuda_graph "
                "zeroshard captures the step: give one of the two",
            )
        self._decode_compile = options
        self._decoder = None
        self._pick_kernels(options)  # measured again as the compiled step will run them

    def _static_decoder(self, batch: int) -> StaticDecoder | None:
        """The static decoder for ``batch`` rows (a new one, captured again, when the
        batch size changes), or None for the ordinary eager loop."""
        capture = self.config.enable_cuda_graph
        if not capture and self._decode_compile is None:
            return None
        if self._decoder is None or self._decoder.batch != batch:
            from zeroshard.inference.decode_graph import StaticDecoder

            self._decoder = None  # free the old cache first
            seq = getattr(self.module.cfg, "seq_len", self.config.max_out_tokens)
            self._decoder = StaticDecoder(
                self.module,
                batch,
                min(self.config.max_out_tokens, seq),
                capture=capture,
                compile_options=self._decode_compile,
            )
        return self._decoder

    # -- tensor parallelism and weight streaming (tensor_parallel.py, streaming.py) -----------
    def _apply_tensor_parallel(self) -> None:
        import torch.distributed as dist

        from zeroshard.distributed.process_group import init_distributed
        from zeroshard.inference.tensor_parallel import inference_mesh, shard_for_inference

        n = self.config.tp_size
        if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            init_distributed()
        if not dist.is_initialized():
            raise ConfigError(
                "tensor_parallel.tp_size",
                f"tp_size={n} needs {n} ranks: launch with `zeroshard generate --nproc {n}` "
                f"or `zeroshard run --nproc {n} script.py` (torch.distributed is not initialized)",
            )
        mesh = inference_mesh(n, self._device().type)
        self.tp = shard_for_inference(
            self.module, mesh.comm("tp"), tp_plan=self.config.tensor_parallel.tp_plan
        )

    def _checkpoint_path(self):
        path, base = self.config.checkpoint, self.config.base_dir
        if isinstance(path, str) and base and not os.path.isabs(path):
            path = os.path.join(base, path)
        return path

    def _check_meta_model(self) -> None:
        c = self.config
        if c.checkpoint is None:
            raise ConfigError(
                "checkpoint",
                "the model is on the meta device: give the safetensors export its weights "
                "are streamed from (checkpoint), or build the model with real weights",
            )
        for at, on in (("tensor_parallel.tp_size", c.tp_size > 1), ("quant", c.num_bits)):
            if on:
                raise ConfigError(
                    at,
                    "a model on the meta device streamed from its checkpoint cannot be "
                    f"split or quantized first ({at}); build it with real weights",
                )

    def _apply_streaming(self) -> None:
        from zeroshard.inference.stream_store import safetensors_init
        from zeroshard.inference.streaming import plan_units, stream_config, stream_weights

        tag = f"rank{self.tp.rank}" if self.tp is not None else "rank0"
        if self.tp is None:
            import torch.distributed as dist

            tag = f"rank{dist.get_rank()}" if dist.is_initialized() else tag
        init = None
        if self._stream_from_file:
            init = safetensors_init(self._checkpoint_path(), plan_units(self.module))
        assert self.config.zero is not None  # called only with a zero section
        self.streaming = stream_weights(
            self.module, stream_config(self.config.zero), tag=tag, init=init
        )

    def _quantize(self) -> None:
        w = self.config.quant.weight
        bits = self.config.num_bits
        assert bits is not None  # called only with quantization on
        self.quantized = quantize_model(
            self.module,
            bits=bits,
            group_size=w.group_size,
            symmetric=w.q_type == "symmetric",
            skip=tuple(self.config.quant.skip),
        )
        if self.tp is not None:  # the column/row-parallel layers hold their local slices
            from zeroshard.inference.tensor_parallel import quantize_sharded

            self.quantized += quantize_sharded(
                self.module,
                bits=bits,
                group_size=w.group_size,
                symmetric=w.q_type == "symmetric",
                skip=tuple(self.config.quant.skip),
            )

    # -- use ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward, without gradients."""
        return self.module(*args, **kwargs)

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes the Linear-layer weights hold, scales included; their fp32 bytes)."""
        return weight_bytes(self.module)

    def save_quantized(self, path: str) -> str:
        """Write the model's weights (quantized layers in their portable form) to one
        safetensors file that ``init_inference(model, checkpoint=path)`` loads."""
        from zeroshard.inference.weights import save_quantized

        return save_quantized(self.module, path)

    def generate(
        self,
        inputs: torch.Tensor | Sequence[Sequence[int]] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int = 32,
        min_new_tokens: int = 0,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        use_cache: bool = True,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Prompt tokens in, prompt plus new tokens out ([batch, T + n]).

        ``inputs``: ids [batch, T] (left-padded, with ``attention_mask``) or a list of
        token lists of any lengths (padded here). Greedy unless ``do_sample``; sampling
        reads ``temperature``, ``top_k``, ``top_p`` and ``seed``/``generator``. Rows stop
        at any of ``eos_token_id`` and are filled with ``pad_token_id`` after it.
        Hugging Face models take the rest of their ``generate()`` keywords too."""
        ids = input_ids if input_ids is not None else inputs
        if ids is None:
            raise InferenceError("generate: give the prompt tokens (inputs or input_ids)")
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
        pad = pad_token_id if pad_token_id is not None else (stops[0] if stops else 0)
        device = self._device()
        if not isinstance(ids, torch.Tensor):
            ids, attention_mask = pad_prompts(ids, pad, device)
        ids = ids.to(device)
        if ids.dim() == 1:
            ids = ids[None]
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        limit = self.config.max_out_tokens
        if ids.shape[1] + max_new_tokens > limit:
            raise InferenceError(
                f"a prompt of {ids.shape[1]} tokens plus max_new_tokens={max_new_tokens} is "
                f"over max_out_tokens={limit}; ask for fewer tokens or raise max_out_tokens"
            )
        if self.tp is not None and do_sample and seed is None and generator is None:
            seed = self._agreed_seed()  # ranks of a TP group must draw the same tokens
        if generator is None and seed is not None:
            generator = torch.Generator(device=device).manual_seed(seed)
        if _is_hf(self.module):
            return self._hf_generate(ids, attention_mask, max_new_tokens, min_new_tokens,
                                     do_sample, temperature, top_k, top_p, stops, pad_token_id,
                                     use_cache, seed, kwargs)  # fmt: skip
        if kwargs:
            raise TypeError(f"generate: unexpected keyword(s) {sorted(kwargs)} for this model")
        sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)  # fmt: skip
        return generate_tokens(
            self.module,
            ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens,
            sampling=sampling,
            stop_ids=stops,
            pad_id=pad,
            use_cache=use_cache and _has_cache_path(self.module),
            max_len=limit,
            generator=generator,
            decoder=self._static_decoder(ids.shape[0]) if use_cache else None,
        )

    def _hf_generate(self, ids, mask, max_new, min_new, do_sample, temperature, top_k, top_p,
                     stops, pad_id, use_cache, seed, kwargs: Mapping[str, Any]) -> torch.Tensor:  # fmt: skip
        args: dict[str, Any] = dict(
            input_ids=ids,
            max_new_tokens=max_new,
            min_new_tokens=min_new or None,
            do_sample=do_sample,
            use_cache=use_cache,
        )
        if mask is not None:
            args["attention_mask"] = mask.long()
        if do_sample:
            args.update(temperature=temperature, top_k=top_k or None, top_p=top_p)
            if seed is not None:
                torch.manual_seed(seed)  # transformers samples from the global generator
        if stops:
            args["eos_token_id"] = stops
        if pad_id is not None:
            args["pad_token_id"] = pad_id
        args.update(kwargs)
        with torch.no_grad():
            return self.module.generate(**{k: v for k, v in args.items() if v is not None})  # type: ignore[operator]

    def _agreed_seed(self) -> int:
        """A fresh seed drawn on the tensor-parallel group's rank 0 and broadcast."""
        seed = torch.randint(0, 2**62, (1,), device=self._device())
        assert self.tp is not None  # called only under tensor parallelism
        self.tp.comm.broadcast(seed, src=0)
        return int(seed.item())

    def _device(self) -> torch.device:
        for t in self.module.parameters():
            return t.device
        for b in self.module.buffers():
            return b.device
        return torch.device("cpu")


def init_inference(
    model: nn.Module, config: Mapping[str, Any] | str | InferenceConfig | None = None, **kwargs: Any
) -> InferenceEngine:
    """DeepSpeed's ``deepspeed.init_inference``: ``config`` is a dict or JSON file of
    DeepSpeed's inference keys, ``kwargs`` the same keys as arguments (they win).

    >>> engine = zeroshard.init_inference(model, {"quant": {"enabled": True, "weight": {"num_bits": 4}}})
    >>> out = engine.generate(prompt_ids, max_new_tokens=64)
    """
    cfg, reading = load_inference_config(config, **kwargs)
    for at, reason in reading.inert:
        if at in ("replace_with_kernel_inject", "kernel_inject"):
            print(f"zeroshard: {at}: there are no kernels to inject; torch's own kernels run")
        else:
            print(f"zeroshard: {at} is accepted and means nothing here: {reason}")
    return InferenceEngine(model, cfg)
