"""`python -m experiments.tiny_checkpoint DIR`: a random-weight Llama checkpoint with a word-level tokenizer.

For serving tests on machines that cannot download a model: our server and vLLM load the same directory
(config.json, model.safetensors, tokenizer files) and, greedy, generate the same tokens. Defaults: the 44M Llama
of the serving issue (4 layers, hidden 512, vocab 32000).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def make_checkpoint(directory: str | Path, num_layers: int = 4, hidden_size: int = 512, num_heads: int = 8,
                    num_kv_heads: int = 4, intermediate_size: int = 1408, vocab_size: int = 32000,
                    max_position_embeddings: int = 2048, seed: int = 0, weight_std: float = 0.05) -> Path:
    """Save a random Llama (float32, safetensors) and a whitespace word-level tokenizer (words w0, w1, ...,
    EOS id 1 named </s>, a simple chat template) into ``directory``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings, bos_token_id=0, eos_token_id=1, torch_dtype="float32")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * weight_std)
    model.save_pretrained(out, safe_serialization=True)
    words = ["<s>", "</s>", "[UNK]", "user", "assistant", "system"]
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>",
                                                eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}assistant{% endif %}")
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(make_checkpoint(a.directory, num_layers=a.layers, hidden_size=a.hidden, vocab_size=a.vocab, seed=a.seed))


if __name__ == "__main__":
    main()
