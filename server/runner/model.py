"""Model loading: the embedded GGUF, any llama GGUF, an mlx-lm directory or a hub id.

Owns: `LoadedModel` (model + tokenizer + the numbers the rest of the server prices with),
`load_model` and `model_shape` (the one reader of mlx-lm's model args for the model's
dimensions: everything else is handed the `ModelShape` it builds, `LoadedModel.shape`).
Called once at start-up by `segserve.server.runtime`, on the main thread before the engine
thread starts; every weight is evaluated here, so the engine thread (MLX's
owner from then on) never meets a lazy array of another thread's stream.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from segserve.config.settings import Settings
from segserve.kernels import act_cpu, qmv_cuda
from segserve.kernels.hook import layer_windows
from segserve.kernels.qmm_cpu import Q6KEmbedding
from segserve.kv.shape import ModelShape
from segserve.server.runner.batched import DecodeBackend
from segserve.server.runner.cpu_layout import apply_cpu_layout
from segserve.server.runner.gemma2_window import install_gemma2_windows
from segserve.server.runner.gguf import (
    X8_BY_MAIN_TYPE,
    ModelLoadError,
    embedded_model_path,
    load_gguf,
    widen_5bit_default,
)
from segserve.server.runner.gguf_arch import smollm3_as_llama
from segserve.server.runner.gpu_layout import fuse_projections
from segserve.server.runner.longrope import install_longrope, longrope_for_phi3
from segserve.server.runner.qweights import (
    QUANT_BITS,
    describe_bits,
    file_quantization,
    float32_activations,
    quantize_float,
    requantize,
    route_cpu,
    weights_plan,
)
from segserve.server.runner.sampling import SamplingDefaults, read_generation_config
from segserve.server.runner.tokenizer import ChatTokenizer, from_gguf_metadata, from_mlx_lm

# kv-2: the cache stores K/V in `kv_dtype` (float16 for a GGUF served through its quantized
# weights on CPU, where kv-1 stored the float32 activations under the same name).
KV_LAYOUT_VERSION = "segserve-kv-2"

log = logging.getLogger("segserve.runner")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: nn.Module
    tokenizer: ChatTokenizer
    model_id: str
    source: str
    revision: str  # content identity of the weights file(s)
    quantization: str
    shape: ModelShape  # the model's dimensions, read once at load (`model_shape`)
    context_length: int
    kv_dtype: str  # what the cache stores (and admission prices): the embedding's dtype
    kv_bytes_per_token: int
    weights_bytes: int
    # The dtype queries (and the K/V the layers compute) arrive in; "" = kv_dtype. float32
    # with a float16 kv_dtype is the CPU's half-size cache: rows are rounded on write.
    query_dtype: str = ""
    # The model's own sampling defaults (`--generation-config auto`); empty = OpenAI's.
    sampling_defaults: SamplingDefaults = SamplingDefaults()
    # `cpu_native_layers`: batched decode may run the layers on the native CPU ops.
    native_layers: bool = True
    # Batched decode of this model (compiled layers, support verdict: built once, on first
    # use, and shared by every runner over this LoadedModel); made from the fields above.
    decode: DecodeBackend = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        backend = DecodeBackend(self.model, self.shape, native_layers=self.native_layers)
        object.__setattr__(self, "decode", backend)  # frozen: set once, here

    @property
    def num_layers(self) -> int:
        return self.shape.num_layers

    @property
    def n_kv_heads(self) -> int:
        return self.shape.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    @property
    def namespace(self) -> tuple[str, ...]:
        """Everything that changes KV rows: the bank keys every entry by it."""
        return (
            self.model_id,
            self.revision,
            self.quantization,
            self.kv_dtype,
            KV_LAYOUT_VERSION,
            self.tokenizer.fingerprint,
            # The template decides which tokens a conversation's rows were computed from;
            # hashed here too so a replaced template never meets rows of the old one even
            # where a tokenizer's fingerprint leaves it out.
            hashlib.blake2b(self.tokenizer.chat_template.encode(), digest_size=12).hexdigest(),
        )


def stock_mode(loaded: LoadedModel) -> LoadedModel:
    """The model as stock mode serves it: mlx-lm's cache stores rows as the layers compute
    them (`query_dtype`), so that is its `kv_dtype`, price and bank namespace."""
    if not loaded.query_dtype or loaded.query_dtype == loaded.kv_dtype:
        return loaded
    size = getattr(mx, loaded.query_dtype).size
    per_token = kv_bytes_per_token(loaded.num_layers, loaded.n_kv_heads, loaded.head_dim, size)
    return dataclasses.replace(loaded, kv_dtype=loaded.query_dtype, kv_bytes_per_token=per_token)


def kv_bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V rows of every layer for one token: what one more token of history costs.
    The one place of this rule (the loader, the benchmarks' random models and the tests'
    tiny models all use it)."""
    return num_layers * 2 * n_kv_heads * head_dim * dtype_bytes


def _file_revision(path: Path) -> str:
    return _content_identity([(path.name, path)])


def _content_identity(files: list[tuple[str, Path]]) -> str:
    """Size + first and last MiB of each file (by name): cheap (2 MiB a file, not the whole
    weights) and it changes when a file is replaced by other weights: the first MiB holds
    a safetensors/GGUF header (tensor names, shapes, offsets, metadata), the last MiB the
    end of the data. No mtime: replicas sharing an SSD tier load their own copies of the
    same files (other mtimes) and must still share what they stored."""
    h = hashlib.blake2b(digest_size=12)
    for name, path in files:
        size = path.stat().st_size
        h.update(f"{name}\0{size}\0".encode())
        with path.open("rb") as f:
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()


def dir_revision(directory: Path) -> str:
    """Content identity of an mlx-lm directory: its weight shards, index and config."""
    names = ("*.safetensors", "*.safetensors.index.json", "config.json")
    files = sorted({p for pattern in names for p in directory.glob(pattern) if p.is_file()})
    return _content_identity([(p.name, p) for p in files])


def _local_dir(spec: str) -> Path | None:
    """Where mlx-lm loaded `spec` from: the directory, or the hub cache's snapshot."""
    if Path(spec).is_dir():
        return Path(spec)
    try:
        from mlx_lm.utils import hf_repo_to_path

        return Path(hf_repo_to_path(spec))  # local files only: the load just fetched them
    except Exception:  # not a hub id in the cache (mlx-lm raises several kinds)
        return None


def _arrays_in(value: Any, out: list[mx.array]) -> None:
    if isinstance(value, mx.array):
        out.append(value)
    elif isinstance(value, nn.Module):
        return  # a child module: `named_modules` visits it on its own
    elif isinstance(value, dict):
        for v in value.values():
            _arrays_in(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _arrays_in(v, out)


def materialize(model: nn.Module) -> int:
    """Evaluate every array the model's modules hold, parameters or not; returns how many.

    Why not `model.parameters()` only: modules keep derived arrays under private names,
    which `parameters()` leaves out (Llama 3's scaled RoPE builds `_freqs` lazily in its
    constructor, phi3's long-RoPE and others too). Left lazy, such an array belongs to
    the loading thread's stream and the engine thread's first forward fails with "There
    is no Stream(cpu, 0) in current thread"."""
    found: list[mx.array] = []
    for _, mod in model.named_modules():
        for value in mod.values():  # a Module is a dict: arrays, lists, dicts, children
            _arrays_in(value, found)
        for value in vars(mod).values():  # plain attributes (never parameters)
            _arrays_in(value, found)
    mx.eval(found)
    return len(found)


def _weights_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())  # [(name, array)]; its stub says str too
    return sum(int(v.nbytes) for _, v in flat)


def model_shape(model: nn.Module) -> ModelShape:
    """The model's dimensions from its mlx-lm args (gemma3's text-in-vision wrapper: its
    language model's) and its own caches; the head's tie from the module tree
    (`tied_head`)."""
    args: Any = getattr(model, "args", None)
    if not hasattr(args, "num_attention_heads") and hasattr(model, "language_model"):
        args = getattr(model.language_model, "args", args)
    heads = int(getattr(args, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(args, "num_key_value_heads", heads) or heads)
    hidden = int(getattr(args, "hidden_size", 0) or 0)
    head_dim = int(getattr(args, "head_dim", 0) or (hidden // heads if heads else 0))
    layers = getattr(model, "layers", None)
    vocab = getattr(args, "vocab_size", 0)
    windows = layer_windows(model)
    return ModelShape(
        num_layers=len(layers) if layers is not None else int(getattr(args, "num_hidden_layers", 0) or 0),
        n_q_heads=heads,
        n_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=int(getattr(args, "intermediate_size", 0) or 0),
        vocab_size=vocab if isinstance(vocab, int) else 0,
        max_position_embeddings=int(getattr(args, "max_position_embeddings", 0) or 0),
        windows=() if isinstance(windows, str) else windows,
        cache_refusal=windows if isinstance(windows, str) else "",
        tie_word_embeddings=tied_head(model),
        attn_logit_softcapping=float(getattr(args, "attn_logit_softcapping", 0.0) or 0.0),
    )


def _kv_dtypes(model: nn.Module, file_rows: mx.Dtype | None = None) -> tuple[mx.Dtype, mx.Dtype]:
    """The KV storage dtype and the query dtype (`file_rows`: the embedding rows' dtype in
    the file, when `float32_embedding_rows` widened them).

    K/V are stored in the embedding's dtype, the precision the weights file keeps (float16
    scales of a GGUF's quantized rows); the layers compute in whatever the first norm
    promotes to (float32 on CPU for a GGUF). Why store the narrower one: it halves the
    cache, the bank and the bytes attention reads per decoded token, as llama.cpp's float16
    cache does, and the attention op keeps scores and sums in float32 either way."""
    probe = model.model.embed_tokens(mx.array([[0]]))
    blocks = getattr(getattr(model, "model", None), "layers", None) or [None]
    norm = getattr(blocks[0], "input_layernorm", None)  # llama-style blocks; else the embedding's
    query = norm(probe).dtype if callable(norm) else probe.dtype
    stored = file_rows if file_rows is not None else probe.dtype
    return stored, query


def load_model(settings: Settings) -> LoadedModel:
    # --weights: float32 (dequantized + BLAS on CPU), q4/q8 (the CPU quantized matmul
    # extension, after a self-check on the model's shapes), quantized (MLX's own kernels).
    plan = weights_plan(settings)
    spec = settings.model
    path = Path(spec) if spec else embedded_model_path()
    from_file = False  # an mlx-lm directory that is quantized on disk
    defaults = SamplingDefaults()  # a GGUF carries none that this loader reads
    x8 = ""  # the quantized products' own rounding of x (`qmm_cpu.CpuQuantizedLinear.x8`)
    if path.suffix == ".gguf" or (spec is None):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        # 5-bit codes are widened to 8-bit, and Q6_K kept in its own blocks, only where the
        # CPU extension will serve them (q4/q8 on a CPU where it is built): MLX's own kernels
        # (`--weights quantized`, a GPU) take 5 bits as they are (widening there costs 1.5x
        # their bytes for nothing) and Q6_K as 8-bit affine (they have no 16-weight groups).
        widen = plan.mode in QUANT_BITS and widen_5bit_default()
        g = load_gguf(path, dequantize=plan.mode == "float32", widen_5bit=widen, q6k_blocks=widen,
                      k_scales=widen)
        tok, _ = from_gguf_metadata(g.metadata)
        default_id = str(g.metadata.get("general.name") or path.stem)
        model, quant, revision = g.model, g.quantization, _file_revision(path)
        if settings.qmm_x8 is None:
            x8 = X8_BY_MAIN_TYPE.get(g.main_type, "")  # llama.cpp's arithmetic for the file's type
        default_context = 2048  # when the file does not say
        model_id = "SmolLM2-135M-Instruct" if spec is None else default_id
        if plan.mode == "q8" and requantize(model, 8):
            quant = describe_bits(model) + " (re-quantized from GGUF)"
    else:
        d = _load_mlx_lm(spec, plan.mode, plan.auto)
        model, tok, quant, revision, model_id = (
            d.model, d.tokenizer, d.quantization, d.revision, d.model_id)
        default_context = 4096  # when config.json does not say
        from_file = d.quantized
        if settings.generation_config == "auto":
            defaults = _generation_defaults(spec)
            if defaults.source:
                log.info("sampling defaults from %s: %s", defaults.source, defaults.as_dict())
        if plan.auto and not d.quantized:
            plan = weights_plan(settings.model_copy(update={"weights": "float32"}))
    shape = model_shape(model)
    file_rows: mx.Dtype | None = None  # the embedding rows' own dtype, when widened below
    if plan.note and not from_file:
        log.warning("weights: serving float32: %s", plan.note)
    if plan.cpu and (plan.mode in QUANT_BITS or (from_file and plan.auto)):
        file_rows = float32_embedding_rows(model)
        ok, how = route_cpu(model, shape, x8)
        if ok:
            log.info("weights %s: %s", plan.mode, how)
            quant += " [CPU qmm extension]"
        elif from_file:  # a quantized directory is never dequantized unasked
            log.warning("weights: MLX's own (slow) CPU quantized matmul: %s", how)
            quant += " [MLX quantized matmul]"
        elif plan.auto:
            log.warning("weights: serving float32: %s", how)
            return load_model(settings.model_copy(update={"weights": "float32"}))
        else:
            log.warning("weights %s: MLX's own (slow) CPU quantized matmul: %s", plan.mode, how)
    if mx.default_device() == mx.cpu and settings.cpu_layout:
        report = apply_cpu_layout(model, shape)
        if report.linears:
            quant += f" [in,out] layout (+{report.extra_bytes >> 20} MiB head copy)"
    if mx.default_device() == mx.cpu:
        # MLX's CPU exp/tanh run element by element: the MLP's gate through the native op.
        routed = act_cpu.install(model)
        log.info("MLP activation: %s", f"native CPU op ({', '.join(routed)})" if routed
                 else f"MLX's ops ({act_cpu.available()[1]})")
    else:
        # A GPU decode step of a few sessions is bound by building and launching its ops.
        fused = fuse_projections(model)
        if fused:
            log.info("projections: %d groups of q/k/v and gate/up each one product", fused)
        if settings.gpu_small_qmm == "on" and mx.cuda.is_available():
            small = qmv_cuda.install(model)
            if small:
                log.info("quantized products of 2-%d rows: %d layers in one pass over their weights "
                         "(segserve.kernels.qmv_cuda)", qmv_cuda.MAX_ROWS, small)
    # Materialize every array now, on this thread: a lazy array made on this thread's
    # stream cannot be evaluated later by the engine thread (MLX streams are per thread).
    materialize(model)
    dtype, query = _kv_dtypes(model, file_rows)
    per_token = kv_bytes_per_token(shape.num_layers, shape.n_kv_heads, shape.head_dim, dtype.size)
    return LoadedModel(
        model=model,
        tokenizer=tok,
        model_id=settings.served_model_name or model_id,
        source=str(path),
        revision=revision,
        quantization=quant,
        shape=shape,
        context_length=shape.max_position_embeddings or default_context,
        kv_dtype=str(dtype).replace("mlx.core.", ""),
        kv_bytes_per_token=per_token,
        weights_bytes=_weights_bytes(model),
        query_dtype=str(query).replace("mlx.core.", ""),
        sampling_defaults=defaults,
        native_layers=settings.cpu_native_layers,
    )


def tied_head(model: nn.Module) -> bool:
    """Whether the model's logits come from its embedding (the module tree says: an
    mlx-lm model builds `lm_head` only when its head is not tied).

    Why not the args' flag: mlx-lm's gemma3_text ties with a flag on the model (its
    `sanitize` drops `lm_head`) and gemma2 always ties with no flag anywhere. The shape's
    tie flag routes the head through the CPU extension; read from the args, those two
    families computed every prefill chunk's logits of all rows through MLX's own
    quantized matmul (a 256-token gemma3 prefill: 10.4 s, of which 0.27 s the layers)."""
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed is not None and "lm_head" not in model


def float32_embedding_rows(model: nn.Module) -> mx.Dtype | None:
    """Float32 scales and biases on a quantized embedding whose rows reach a product before
    any norm (olmo2: no norm before attention); the rows' dtype before, if changed (None:
    unchanged).

    Why: elsewhere the first norm's float32 weight promotes the float16 rows (float16 scales
    of a GGUF or a quantized directory) to float32, the CPU extension's dtype. Without it,
    layer 0's q/k/v products took float16 rows, which the extension declines: MLX's own
    float16 quantized matmul served them, slower and less precise than every other layer
    (the batched decode's native layers, computing in float32, then disagreed with the
    forward and were refused). Cost: 2 more bytes per 32 embedding weights. The KV rows keep
    the file's precision (`load_model` hands the dtype returned here to `_kv_dtypes`)."""
    blocks = getattr(getattr(model, "model", None), "layers", None) or [None]
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    if hasattr(blocks[0], "input_layernorm"):
        return None
    if isinstance(emb, Q6KEmbedding):  # its rows are dequantized on lookup: widen those
        was = emb.rows_dtype
        emb.rows_dtype = mx.float32
        return None if was == mx.float32 else was
    if not isinstance(emb, nn.QuantizedEmbedding):
        return None
    before: mx.Dtype = emb.scales.dtype
    if before == mx.float32:
        return None
    emb.scales, emb.biases = emb.scales.astype(mx.float32), emb.biases.astype(mx.float32)
    mx.eval(emb.scales, emb.biases)
    return before


def _generation_defaults(spec: str) -> SamplingDefaults:
    """generation_config.json of a local directory, or of a hub id already in the local
    cache (read offline: mlx-lm's load fetched the repository moments ago)."""
    if Path(spec).is_dir():
        return read_generation_config(Path(spec) / "generation_config.json")
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # mlx-lm depends on it; without it there is no hub id to read
        return SamplingDefaults()
    found = try_to_load_from_cache(spec, "generation_config.json")
    return read_generation_config(Path(found)) if isinstance(found, str) else SamplingDefaults()


@dataclass(frozen=True, slots=True)
class _MlxLmDir:
    model: nn.Module
    tokenizer: ChatTokenizer
    quantization: str  # what the start-up log and /health report
    revision: str
    model_id: str
    quantized: bool  # the layers are quantized as served (file or load-time)


def _load_mlx_lm(spec: str, mode: str, auto: bool) -> _MlxLmDir:
    """An mlx-lm directory (or hub id) in the form `mode` asks for.

    A quantized directory (config.json `quantization`) keeps its quantized layers unless
    float32 is asked for explicitly: on the CPU they compute in float32 through the
    extension where bits and group size fit (`load_model` routes them), MLX's own
    quantized kernels otherwise. Dequantizing under `auto` would multiply the weights'
    bytes by 4-8 for a file the user chose to quantize."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import dequantize_model

    try:
        loaded: Any = mlx_lm_load(spec, return_config=True)  # typed as the 2-tuple form too
        model, wrapper, config = loaded
    except Exception as exc:  # mlx-lm raises many kinds (FileNotFound, HF errors...)
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    tok = from_mlx_lm(wrapper)
    model = smollm3_as_llama(model)  # llama's forward with no-RoPE layers: batched and native serve it
    # Gemma 2's sliding windows (HF configs: `sliding_window`; early ones `sliding_window_size`).
    model = install_gemma2_windows(model, config.get("sliding_window") or config.get("sliding_window_size"))
    longrope = longrope_for_phi3(model)  # short factors below the switch (mlx-lm: long ones only)
    if longrope is not None:
        install_longrope(model, longrope)
    on_cpu = mx.default_device() == mx.cpu
    quantized = file_quantization(config) is not None
    if quantized:
        quant = "mlx-lm " + describe_bits(model)
        if mode == "float32" and not auto:
            model = dequantize_model(model)
            model.set_dtype(mx.float32)
            quant += " dequantized to float32"
            quantized = False
        elif on_cpu:
            bits = QUANT_BITS.get(mode)
            if bits is not None and not auto and requantize(model, bits):
                quant = f"mlx-lm {describe_bits(model)} (re-quantized from {quant[7:]})"
            float32_activations(model)
    elif mode == "float32" or (auto and on_cpu):
        # auto never quantizes a float model (lossy): float32 + BLAS, as before.
        model.set_dtype(mx.float32)
        quant = "mlx-lm unquantized float32"
    elif mode in QUANT_BITS and on_cpu:
        quantize_float(model, QUANT_BITS[mode])
        quant = describe_bits(model) + " (quantized at load)"
        quantized = True
    else:
        quant = f"mlx-lm unquantized {_param_dtype(model)}"
    local = _local_dir(spec)
    revision = (
        dir_revision(local) if local is not None
        else hashlib.blake2b(str(Path(spec).resolve()).encode(), digest_size=12).hexdigest()
    )
    return _MlxLmDir(model, tok, quant, revision, Path(spec).name or spec, quantized)


def _param_dtype(model: nn.Module) -> str:
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())
    kinds = {str(v.dtype).replace("mlx.core.", "") for _, v in flat if mx.issubdtype(v.dtype, mx.floating)}
    return "/".join(sorted(kinds)) or "float"
