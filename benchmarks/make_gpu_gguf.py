"""Write a Llama-shaped GGUF of about 1-3 GB (F16 matrices, F32 norms) for the GPU check: big enough that the
engine's memory breakdown and a concurrency sweep mean something on a real GPU, generated offline in seconds (the
demo model's tokenizer; one random block per tensor shape, reused by every layer, so it costs little RAM or time).

Never downloads anything. The output is not a useful language model; the lm_head rows of the special tokens are
zero (as in the demo), so generation never stops early on EOS and every request produces its max_tokens.

    python benchmarks/make_gpu_gguf.py OUT.gguf [--layers 22] [--hidden 2048] [--ffn 5632]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from desktop.core.models import demo  # noqa: E402


def write(path: Path, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, ctx: int) -> int:
    """Write the file; return its parameter count."""
    tokenizer = demo.build_tokenizer()
    vocab = demo.tokenizer_vocab(tokenizer)
    special = {demo._token_id(tokenizer, token) for token in demo.SPECIAL_TOKENS}
    head_dim = hidden // heads
    rng = np.random.default_rng(demo.SEED)
    std = 0.02

    def block(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float16)

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_name(f"switchyard-gpu-check-{layers}x{hidden}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(ctx)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(demo.RMS_NORM_EPS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(demo.ROPE_THETA)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(vocab))])
    writer.add_token_merges(demo.tokenizer_merges(tokenizer))
    writer.add_bos_token_id(demo._token_id(tokenizer, demo.BOS_TOKEN))
    writer.add_eos_token_id(demo._token_id(tokenizer, demo.EOS_TOKEN))
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(demo.CHAT_TEMPLATE)

    norm = np.ones(hidden, dtype=np.float32)
    q, o = block(hidden, hidden), block(hidden, hidden)
    kv = block(kv_heads * head_dim, hidden)
    up, down = block(ffn, hidden), block(hidden, ffn)
    embed = block(len(vocab), hidden)
    head = block(len(vocab), hidden)
    head[list(special)] = 0  # never EOS: every request runs to max_tokens
    parameters = 0
    tensors: list[tuple[str, np.ndarray]] = [("token_embd.weight", embed)]
    for layer in range(layers):
        b = f"blk.{layer}"
        tensors += [(f"{b}.attn_norm.weight", norm), (f"{b}.attn_q.weight", q), (f"{b}.attn_k.weight", kv),
                    (f"{b}.attn_v.weight", kv), (f"{b}.attn_output.weight", o), (f"{b}.ffn_norm.weight", norm),
                    (f"{b}.ffn_gate.weight", up), (f"{b}.ffn_up.weight", up), (f"{b}.ffn_down.weight", down)]
    tensors += [("output_norm.weight", norm), ("output.weight", head)]
    for name, tensor in tensors:
        writer.add_tensor(name, tensor)
        parameters += int(tensor.size)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return parameters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=8192)
    args = parser.parse_args()
    started = time.monotonic()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    parameters = write(args.out, args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.ctx)
    print(f"{args.out}: {parameters / 1e9:.2f} B parameters, {args.out.stat().st_size / 1024**3:.2f} GiB, "
          f"{time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
