"""Outputs as the model writes them: text and token ids, with the real Kimi BPE.

A piece of structure (``Control``) is encoded with the control ids allowed, so its
atoms are control ids; text is encoded with special tokens disallowed, so any atom
characters in it are BPE pieces (what the renderer does to user, tool and argument
text, and what a model quoting them writes).
"""

from __future__ import annotations

import codecs
import functools
from typing import NamedTuple

from vllm_k3_plugin.format import marked, vocab
from vllm_k3_plugin.tools.tokenizer import load_tiktoken_encoding


class Control(NamedTuple):
    """Structure: atom strings in it become control ids."""

    text: str


@functools.cache
def encoding():
    return load_tiktoken_encoding()


@functools.cache
def atom_tokens() -> marked.AtomTokens:
    enc = encoding()
    return marked.AtomTokens(lambda ids: enc.decode(list(ids)))


def encode(*pieces: str | Control) -> tuple[str, list[int]]:
    """``(text, ids)`` of an output; plain strings are the model's text."""
    enc = encoding()
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, Control):
            ids += enc.encode(piece.text, allowed_special="all")
        else:
            ids += enc.encode(piece, disallowed_special=())
    return enc.decode(ids), ids


def token_chunks(ids: list[int]) -> list[tuple[str, list[int]]]:
    """One ``(text, [id])`` per token, as vLLM's incremental detokenizer hands them
    over: a character split across tokens comes with the token that completes it; a
    stop token ending the output has no text."""
    enc = encoding()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    stop_at = len(ids) - 1 if ids and ids[-1] == vocab.END_OF_MSG_ID else None
    chunks = []
    for at, token in enumerate(ids):
        piece = "" if at == stop_at else enc.decode_single_token_bytes(token)
        chunks.append((decoder.decode(piece or b""), [token]))
    if chunks:
        tail = decoder.decode(b"", final=True)
        chunks[-1] = (chunks[-1][0] + tail, chunks[-1][1])
    return chunks


def id_atoms() -> marked.IdAtoms:
    return marked.IdAtoms(atom_tokens())


_ATOMS = (
    vocab.OPEN,
    vocab.CLOSE,
    vocab.SEP,
    vocab.END_OF_MSG,
)
# Lone low surrogates: no generated or decoded text holds one (private-use
# characters, which it may hold, came back as atoms).
_SHIELDS = {atom: chr(0xDC00 + i) for i, atom in enumerate(_ATOMS)}


def _shield(value):
    if isinstance(value, str):
        for atom, shield in _SHIELDS.items():
            value = value.replace(atom, shield)
        return value
    if isinstance(value, dict):
        return {_shield(key): _shield(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_shield(item) for item in value]
    return value


def marked_rendering(render, calls) -> str:
    """``render(calls)`` as the reader sees it with ids: the renderer's atoms are
    control atoms (marked), atom strings inside names and values are BPE text."""
    text = marked.marked(render([(name, _shield(args)) for name, args in calls]))
    for atom, shield in _SHIELDS.items():
        text = text.replace(shield, atom)
    return text
