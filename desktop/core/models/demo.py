"""The embedded demo model: one small random-weight Llama, written for both engines with identical weights.

Switchyard must be usable (and its A/B meaningful) before the user downloads anything, so on first use it
generates a tiny Llama-architecture model twice over: a GGUF file for llama.cpp and a Hugging Face safetensors
folder for vLLM. Both hold the same float32 weights and the same byte-level BPE tokenizer, and the weights are
scaled so that greedy (temperature 0) next-token choices win by clear margins: both engines then produce the
same greedy tokens for the same prompt, which shows that an A/B compares engines, not models.

Generation is deterministic (fixed seed), takes a few seconds, and is cached per DEMO_VERSION under
`cache_dir()/demo/<DEMO_VERSION>`. It is built in a temporary sibling directory and renamed into place under a
file lock, so a crash never leaves a half-written model that counts as ready.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import filelock
import gguf
import numpy as np
import numpy.typing as npt
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from desktop.core.common import paths
from desktop.core.common.errors import SwitchyardError
from desktop.core.common.progress import ProgressCallback, ProgressEvent, no_progress

# Bump whenever anything below changes the generated files: a new version is generated into a new directory.
DEMO_VERSION = "2"  # 2: the chat template renders tools (Hermes <tool_call>), content parts, tool turns

MANIFEST_NAME = "demo.json"
GGUF_NAME = "demo.gguf"
HF_DIR_NAME = "hf"
MODEL_NAME = "switchyard-demo"

SEED = 20240917
HIDDEN_SIZE = 512
NUM_LAYERS = 8
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 64: vLLM's CPU attention rejects smaller head sizes
INTERMEDIATE_SIZE = 1536
MAX_POSITIONS = 4096
ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-5
TARGET_VOCAB_SIZE = 768

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # ids 0 and 1

# Scales of the random weights. A large embedding keeps the residual stream dominated by the current token,
# small layer weights let the context steer it a little, and a wide lm_head spreads logits (std ~8) so the
# winning token leads the runner-up by far more than float32-vs-float16-KV rounding can move.
EMBEDDING_STD = 1.0
LAYER_STD = 0.02
LM_HEAD_STD = 0.35

# Hermes-style tools (the `<tool_call>` format Qwen and Hermes models use): llama-server recognises it and parses
# `<tool_call>` answers itself, and vLLM's `hermes` parser reads the same, so a tools request works on both engines
# (models.parsers picks `hermes` from the marker). Without tools a string-content chat renders exactly as version 1
# did; list content parts, assistant tool calls (arguments as a JSON string or, as vLLM passes them, an object)
# and `tool` results render too, so an agent's second turn does not fail in the template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>\nTools you may call, one JSON object per line:\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ 'To call one, answer <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>' + eos_token + '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}{{ '}</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# A little English to train the byte-level BPE merges on, so common words become single tokens.
TRAINING_TEXT = """\
Switchyard helps developers serve large language models on their own workstation. It looks at the hardware,
recommends an engine and a quantization, downloads the weights, starts the server and keeps an eye on it.
The same endpoint stays up while the engine behind it changes, so a program that talks to the model never
notices the switch. When two engines can run the same model, an A/B benchmark shows which one is faster for
the work you actually do: short chat turns, long documents, or many users at the same time.

The quick brown fox jumps over the lazy dog. A small model with random weights cannot say anything useful,
but it is enough to show that the engines start, answer requests and report their numbers. The first token
arrives after the prompt has been read; the rest of the answer follows one token at a time. Time to first
token, time per output token and throughput are the numbers that matter most to people who wait for an
answer, and memory is the number that decides whether a model fits at all.

Once upon a time there was a little town by the sea. Every morning the people of the town walked down to the
harbour to see the boats come in. The children ran along the water and the old men sat in the sun and told
stories about the storms of their youth. In the evening the lights of the houses came on one by one, and the
sound of the waves was the last thing anyone heard before they fell asleep.

What is the capital of France? The capital of France is Paris. What is two plus two? Two plus two is four.
How are you today? I am fine, thank you, and how are you? Please tell me a story about a dragon who wanted
to learn how to read. The dragon found a library in the mountains and read every book it could find.
"""

LOCK_TIMEOUT_S = 300.0
PROGRESS_STEPS = ("tokenizer", "weights", "gguf", "safetensors")


@dataclass(frozen=True)
class DemoModel:
    """A ready demo model pair: the GGUF file for llama.cpp and the safetensors folder for vLLM."""

    root: Path
    gguf_path: Path
    hf_dir: Path
    parameters: int

    def path_for(self, model_format: Literal["gguf", "hf"]) -> Path:
        """The model path an engine adapter of the given format loads."""
        if model_format == "gguf":
            return self.gguf_path
        if model_format == "hf":
            return self.hf_dir
        raise ValueError(f"unknown model format {model_format!r} (expected 'gguf' or 'hf')")

    def to_json(self) -> dict[str, Any]:
        return {
            "version": DEMO_VERSION,
            "root": str(self.root),
            "gguf_path": str(self.gguf_path),
            "hf_dir": str(self.hf_dir),
            "parameters": self.parameters,
        }


def default_root() -> Path:
    """Where the current demo version lives, shared by every checkout on the machine."""
    return paths.cache_dir() / "demo" / DEMO_VERSION


def ensure_demo_model(progress: ProgressCallback = no_progress, root: Path | None = None) -> DemoModel:
    """Return the cached demo model, generating it first when it is missing or damaged."""
    root = (root or default_root()).expanduser().absolute()
    cached = _load_cached(root)
    if cached is not None:
        return cached
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        with filelock.FileLock(str(root.parent / f".{root.name}.lock"), timeout=LOCK_TIMEOUT_S):
            cached = _load_cached(root)  # another process may have finished while we waited
            if cached is not None:
                return cached
            _remove_stale_staging(root)
            return _generate_into(root, progress)
    except filelock.Timeout as exc:
        raise SwitchyardError(
            f"another Switchyard process has been generating the demo model in {root.parent} "
            f"for over {LOCK_TIMEOUT_S:.0f} s",
            "wait for it to finish, or end that process and try again",
        ) from exc
    except OSError as exc:
        raise SwitchyardError(
            f"could not write the demo model to {root}: {exc.strerror or exc}",
            "free some disk space or point SWITCHYARD_CACHE_DIR at a writable folder",
        ) from exc


# --- cache -----------------------------------------------------------------------------------------------


def _model_at(root: Path, parameters: int) -> DemoModel:
    return DemoModel(root=root, gguf_path=root / GGUF_NAME, hf_dir=root / HF_DIR_NAME, parameters=parameters)


def _load_cached(root: Path) -> DemoModel | None:
    """The model at root if its manifest matches this version and every file has its recorded size."""
    try:
        manifest = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
        if manifest.get("version") != DEMO_VERSION:
            return None
        files: dict[str, int] = manifest["files"]
        for relative, size in files.items():
            if (root / relative).stat().st_size != size:
                return None
        return _model_at(root, int(manifest["parameters"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _remove_stale_staging(root: Path) -> None:
    """Staging folders left by a process that died mid-generation (we hold the lock, so none is live)."""
    for leftover in root.parent.glob(f".{root.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _generate_into(root: Path, progress: ProgressCallback) -> DemoModel:
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=root.parent))
    try:
        parameters = write_demo_files(staging, progress)
        if root.exists():  # a damaged or outdated copy: we hold the lock, so nobody is reading it as ready
            shutil.rmtree(root)
        os.replace(staging, root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(ProgressEvent(f"Demo model ready in {time.monotonic() - started:.1f} s: {root}", 1.0))
    return _model_at(root, parameters)


def write_demo_files(directory: Path, progress: ProgressCallback = no_progress) -> int:
    """Write the GGUF file, the HF folder and the manifest into directory; return the parameter count."""
    total = len(PROGRESS_STEPS)

    def step(index: int, message: str) -> None:
        progress(ProgressEvent(message, index / total))

    step(0, "Demo model: training the tokenizer")
    tokenizer = build_tokenizer()
    vocab = tokenizer_vocab(tokenizer)
    vocab_size = len(vocab)

    step(1, "Demo model: generating weights")
    weights = dict(generate_weights(vocab))
    parameters = sum(int(tensor.size) for tensor in weights.values())

    step(2, "Demo model: writing GGUF")
    gguf_path = directory / GGUF_NAME
    write_gguf(gguf_path, tokenizer, weights)

    step(3, "Demo model: writing safetensors")
    hf_dir = directory / HF_DIR_NAME
    write_hf(hf_dir, tokenizer, weights)

    files = {
        path.relative_to(directory).as_posix(): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    manifest = {"version": DEMO_VERSION, "parameters": parameters, "vocab_size": vocab_size, "files": files}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return parameters


# --- tokenizer -------------------------------------------------------------------------------------------


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenizer, as llama.cpp's "gpt-2" pre type) with <s> prepended."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer=trainer)
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    index = tokenizer.token_to_id(token)
    if index is None:
        raise RuntimeError(f"the demo tokenizer lacks {token!r}")
    return index


def tokenizer_vocab(tokenizer: Tokenizer) -> list[str]:
    """Token strings in id order."""
    by_id = {index: token for token, index in tokenizer.get_vocab(with_added_tokens=True).items()}
    return [by_id[index] for index in range(len(by_id))]


def tokenizer_merges(tokenizer: Tokenizer) -> list[str]:
    """BPE merges as "left right" strings, in priority order (the form GGUF stores)."""
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in merges]


# --- weights ---------------------------------------------------------------------------------------------

FloatArray = npt.NDArray[np.float32]


def generate_weights(vocab: list[str]) -> Iterator[tuple[str, FloatArray]]:
    """The model's tensors under their Hugging Face names, in HF layout, deterministic for a given vocab."""
    vocab_size = len(vocab)
    rng = np.random.default_rng(SEED)

    def normal(std: float, *shape: int) -> FloatArray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    def norm_weight() -> FloatArray:
        return (1.0 + normal(0.05, HIDDEN_SIZE)).astype(np.float32)

    kv_dim = NUM_KV_HEADS * HEAD_DIM
    yield "model.embed_tokens.weight", normal(EMBEDDING_STD, vocab_size, HIDDEN_SIZE)
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        yield f"{prefix}.input_layernorm.weight", norm_weight()
        yield f"{prefix}.self_attn.q_proj.weight", normal(LAYER_STD, NUM_HEADS * HEAD_DIM, HIDDEN_SIZE)
        yield f"{prefix}.self_attn.k_proj.weight", normal(LAYER_STD, kv_dim, HIDDEN_SIZE)
        yield f"{prefix}.self_attn.v_proj.weight", normal(LAYER_STD, kv_dim, HIDDEN_SIZE)
        yield f"{prefix}.self_attn.o_proj.weight", normal(LAYER_STD, HIDDEN_SIZE, NUM_HEADS * HEAD_DIM)
        yield f"{prefix}.post_attention_layernorm.weight", norm_weight()
        yield f"{prefix}.mlp.gate_proj.weight", normal(LAYER_STD, INTERMEDIATE_SIZE, HIDDEN_SIZE)
        yield f"{prefix}.mlp.up_proj.weight", normal(LAYER_STD, INTERMEDIATE_SIZE, HIDDEN_SIZE)
        yield f"{prefix}.mlp.down_proj.weight", normal(LAYER_STD, HIDDEN_SIZE, INTERMEDIATE_SIZE)
    yield "model.norm.weight", norm_weight()
    yield "lm_head.weight", _lm_head(normal(LM_HEAD_STD, vocab_size, HIDDEN_SIZE), vocab)


def _lm_head(random_rows: FloatArray, vocab: list[str]) -> FloatArray:
    """Zero the rows of tokens the demo should never emit: specials and non-printable single bytes.

    A zero row scores 0 while the winner among hundreds of ~N(0, 8) logits scores far above, so greedy output
    stays printable ASCII (no half UTF-8 sequences that engines would render differently) and never stops
    early on </s>: benchmarks get their full max_tokens.
    """
    head = random_rows.copy()
    printable = {" ", "\n"} | {chr(code) for code in range(0x21, 0x7F)}
    char_to_byte = {char: byte for byte, char in enumerate(_bytes_to_unicode())}
    for index, token in enumerate(vocab):
        if token in SPECIAL_TOKENS or (len(token) == 1 and chr(char_to_byte[token]) not in printable):
            head[index] = 0.0
    return head


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (index = byte value)."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    visible += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {byte: chr(byte) for byte in visible}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return [table[byte] for byte in range(256)]


def permute_for_llamacpp(weights: FloatArray, n_head: int) -> FloatArray:
    """Reorder Q/K rows from HF's rotate-half RoPE layout to llama.cpp's interleaved one (convert_hf_to_gguf)."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, 2, rows // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def unpermute_from_llamacpp(weights: FloatArray, n_head: int) -> FloatArray:
    """Inverse of permute_for_llamacpp."""
    rows = weights.shape[0]
    return (
        weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_tensor_name(hf_name: str) -> str:
    """The llama.cpp tensor name for a Hugging Face Llama tensor name."""
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<module>[.<proj>].weight
    layer, module = parts[2], ".".join(parts[3:-1])
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    return f"blk.{layer}.{per_layer[module]}.weight"


# --- writers ---------------------------------------------------------------------------------------------


def write_gguf(path: Path, tokenizer: Tokenizer, weights: dict[str, FloatArray]) -> None:
    """The llama.cpp file: llama.* hyperparameters, the same tokenizer, and Q/K rows permuted for its RoPE."""
    vocab = tokenizer_vocab(tokenizer)
    special_ids = {_token_id(tokenizer, token) for token in SPECIAL_TOKENS}
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(MODEL_NAME)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if index in special_ids else gguf.TokenType.NORMAL
            for index in range(len(vocab))
        ]
    )
    writer.add_token_merges(tokenizer_merges(tokenizer))
    writer.add_bos_token_id(_token_id(tokenizer, BOS_TOKEN))
    writer.add_eos_token_id(_token_id(tokenizer, EOS_TOKEN))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in weights.items():
        if name.endswith("q_proj.weight"):
            tensor = permute_for_llamacpp(tensor, NUM_HEADS)
        elif name.endswith("k_proj.weight"):
            tensor = permute_for_llamacpp(tensor, NUM_KV_HEADS)
        writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(tensor))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_hf(directory: Path, tokenizer: Tokenizer, weights: dict[str, FloatArray]) -> None:
    """The vLLM folder: LlamaForCausalLM config, safetensors weights and a tokenizers-backed tokenizer."""
    directory.mkdir(parents=True)
    vocab_size = tokenizer.get_vocab_size()
    bos_id = _token_id(tokenizer, BOS_TOKEN)
    eos_id = _token_id(tokenizer, EOS_TOKEN)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_theta": ROPE_THETA,
        "vocab_size": vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": LAYER_STD,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    _write_json(directory / "config.json", config)
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": eos_id},
    )
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(directory / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN})
    save_file(
        {name: np.ascontiguousarray(tensor) for name, tensor in weights.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
