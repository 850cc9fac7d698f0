"""Build a tiny random-weight Llama that a real vLLM (CPU build) can serve offline.

No model hub is reachable from the lab or CI, so tests make their own model:
a byte-level BPE tokenizer trained locally with `tokenizers`, and a 2-layer
Llama with hidden size 256 and head_dim 64 (CPU attention rejects head_dim 16).
Weights are written as `pytorch_model.bin` by default so that the converter has
real work to do on the host; `--safetensors` writes them the way hubs ship them.
The tokenizer carries a chat template (written as chat_template.jinja) so that vLLM serves
`/v1/chat/completions`; it lists offered tools and asks for Hermes-style `<tool_call>` answers,
the format of the cpu-lab profile's tool-call parser.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "gpt-oss-20b runs on vLLM with two RTX 4090D GPUs.",
    "Hello world! Tuning a server means measuring it first.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 50

# Plain-text role markers: no new special tokens, so the vocabulary and weights keep their shape.
# Tools are listed as name(arguments) only: the 512-token vocabulary makes full JSON schemas
# longer than the cpu-lab profile's 256-token context.
# `content` may be null on assistant turns that carried tool calls.
CHAT_TEMPLATE = (
    "{% if tools %}<|system|>\nTools you may call:\n"
    "{% for tool in tools %}{{ tool.function.name }}({{ tool.function.parameters.properties | list | join(', ') }})\n"
    "{% endfor %}"
    'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n{% endif %}'
    "{% for message in messages %}<|{{ message.role }}|>\n{{ message.content or '' }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_tokenizer(out_dir: Path, vocab_size: int = 512) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out_dir))


def build_model(out_dir: Path, safetensors: bool, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim = 256 / 4 = 64
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    config.save_pretrained(str(out_dir))
    if safetensors:
        model.save_pretrained(str(out_dir), safe_serialization=True)
    else:
        # transformers 5 only writes safetensors; a .bin checkpoint needs torch.save directly.
        torch.save(model.state_dict(), out_dir / "pytorch_model.bin")
    (out_dir / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def build(out_dir: Path, safetensors: bool = False) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    build_model(out_dir, safetensors)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to create the model in")
    parser.add_argument("--safetensors", action="store_true", help="write model.safetensors instead of .bin")
    args = parser.parse_args(argv)
    build(args.out_dir, args.safetensors)
    print(f"tiny model written to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
