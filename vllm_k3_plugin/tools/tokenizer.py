"""The real Kimi BPE with K3's control ids: as a tiktoken ``Encoding`` and as a HF
``tokenizer.json`` for tiny checkpoints.

The ranks (``data/tiktoken.model``, MIT, from the Kimi Vendor Verifier) cover ids
0..163583; the 256 control slots from 163584 carry the K3 names of ``vocab`` and
reserved names elsewhere.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from vllm_k3_plugin.format import vocab

# The Kimi pre-tokenizer split (Kimi K2's tokenization_kimi.py; K3 keeps the ranks).
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def ranks_path() -> Path:
    return Path(str(resources.files("vllm_k3_plugin") / "data" / "tiktoken.model"))


def chat_template() -> str:
    """The tiny checkpoints' chat template: the K3 turns, ending the prompt with the
    K3 generation prefix (thinking on or off)."""
    data = resources.files("vllm_k3_plugin") / "data"
    return (data / "chat_template.jinja").read_text()


def control_tokens() -> dict[str, int]:
    """All 256 control slots, by name: K3's names, ``<|reserved_token_N|>`` else."""
    named = {**vocab.SPECIAL_TOKENS, **vocab.ADDED_TOKENS}
    by_id = {token_id: name for name, token_id in named.items()}
    return {
        by_id.get(token_id, f"<|reserved_token_{token_id}|>"): token_id
        for token_id in range(vocab.CONTROL_ID_BASE, vocab.VOCAB_SIZE)
    }


def load_tiktoken_encoding():
    """A tiktoken ``Encoding`` of the K3 vocabulary."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(ranks_path()))
    if len(ranks) != vocab.BPE_RANK_COUNT:
        raise ValueError(
            f"{ranks_path()} has {len(ranks)} ranks, expected {vocab.BPE_RANK_COUNT}"
        )
    return tiktoken.Encoding(
        name="kimi_k3",
        pat_str=KIMI_PATTERN,
        mergeable_ranks=ranks,
        special_tokens=control_tokens(),
    )


def write_hf_tokenizer(out_dir: Path, chat_template: str) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``.

    ``<|open|>``, ``<|close|>`` and ``<|sep|>`` are added but not special, as in the
    published tokenizer, so ``skip_special_tokens`` keeps them in the text.
    """
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    converter = TikTokenConverter(vocab_file=str(ranks_path()), pattern=KIMI_PATTERN)
    tokenizer = converter.converted()
    added = []
    for name, token_id in control_tokens().items():
        if tokenizer.get_vocab_size(with_added_tokens=True) != token_id:
            raise ValueError(f"control token {name} would not get id {token_id}")
        special = name not in vocab.ADDED_TOKENS
        added.append(AddedToken(name, special=special, normalized=False))
        tokenizer.add_tokens([added[-1]])
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": vocab.BOS_TOKEN,
        "eos_token": vocab.END_OF_MSG,
        "pad_token": vocab.PAD_TOKEN,
        "unk_token": vocab.UNK_TOKEN,
        "model_max_length": 1048576,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
