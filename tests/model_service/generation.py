"""Helpers to generate through the real gRPC API and through transformers' own generate()."""

from __future__ import annotations

from typing import NamedTuple

import torch

from model_service.model_loader import LoadedModel
from protos import model_pb2, model_pb2_grpc

# A ~600-token passage: the long shared prefix of several test prompts.
LONG_DOCUMENT = " ".join([
    "The history of the lighthouse keepers of the northern coast is a story of patience and routine.",
    "Every evening the keeper climbed one hundred and twelve steps to light the lamp, trimmed the wick,",
    "polished the great lens and wrote the state of the sea, the wind and the passing ships in a log.",
    "In the winter of 1887 a storm lasted eleven days; the supply boat could not land, and the keeper,",
    "his wife and their three children lived on salted fish, potatoes and tea brewed from rainwater.",
    "The log of that winter records forty-one ships passing safely and one schooner, the Margaret Ann,",
    "that ran aground on the reef to the south, whose crew of seven were all brought ashore by rope.",
    "Later, electricity replaced the oil lamp, a radio replaced the signal flags, and in 1962 the light",
    "was automated. The last keeper, a quiet man named Tomas Ferreira, left the island that summer with",
    "two suitcases, a cat, and the forty volumes of logs kept by the keepers who came before him.",
    "The logs are now kept in the regional museum, where researchers use them to study the climate of",
    "the nineteenth century: the daily notes of wind direction, cloud cover and temperature form one of",
    "the longest continuous weather records of the region. Historians read them for other reasons too.",
    "They show how the keepers traded with fishermen, how they taught their children to read by lamp",
    "light, how they tended small gardens behind stone walls, and how they kept goats for milk and cheese.",
    "One entry from 1903 reads: 'Fog all day. Sounded the horn every thirty seconds from noon until four.",
    "A whale passed close to the rocks at dusk. The children counted its breaths until it was out of sight.'",
    "Another, from 1921, describes the arrival of the first motor boat, which the keeper thought noisy",
    "and unreliable, and which broke down on its second visit, to his visible satisfaction. The museum",
    "has digitised every page, and volunteers transcribe the handwriting, which changes from keeper to",
    "keeper: some wrote in a careful copperplate, others in hurried pencil, one in a mixture of Portuguese",
    "and English. Together the logs describe seventy-five years of weather, shipping, family life and",
    "solitude on a rock in the sea, and they end with a single line in Ferreira's hand: 'Light automated.",
    "Keeper departs. God keep the ships.' The island is now a nature reserve, home to puffins and seals,",
    "and the tower still flashes twice every ten seconds, seen from twenty nautical miles away on a clear",
    "night. Visitors can climb the steps on summer weekends, and a small exhibition in the keeper's",
    "cottage shows the old lens, a barometer, a kettle, the children's slates and a photograph of the",
    "family standing in front of the tower in their best clothes, squinting into the sun of 1899.",
])

SHARED_PREFIX_SUFFIXES = [
    "In summary,",
    "The keeper's name was",
    "The museum keeps the logs because",
]

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
]


class Generated(NamedTuple):
    token_ids: list[int]
    text: str
    messages: list[model_pb2.GenerateResponse]

    @property
    def final(self) -> model_pb2.GenerateResponse:
        return self.messages[-1]


def correctness_prompts(tokenizer) -> list[list[int]]:
    """Six prompts as token ids: three sharing a >= 500-token prefix, three short ones."""
    long = [tokenizer(f"{LONG_DOCUMENT}\n\n{q}").input_ids for q in SHARED_PREFIX_SUFFIXES]
    assert min(len(ids) for ids in long) >= 500
    return long + [tokenizer(p).input_ids for p in SHORT_PROMPTS]


def generate(stub: model_pb2_grpc.ModelServiceStub, token_ids: list[int] | None = None, *,
             prompt: str | None = None, namespace: str = "", timeout: float = 300.0, **sampling) -> Generated:
    """Runs one streaming Generate call to completion."""
    request = model_pb2.GenerateRequest(namespace=namespace, sampling=model_pb2.SamplingParams(**sampling))
    if token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.prompt = prompt
    messages = list(stub.Generate(request, timeout=timeout))
    return Generated([t for m in messages for t in m.token_ids], "".join(m.text for m in messages), messages)


def greedy(stub: model_pb2_grpc.ModelServiceStub, token_ids: list[int], max_tokens: int) -> Generated:
    return generate(stub, token_ids, temperature=0.0, max_tokens=max_tokens)


@torch.inference_mode()
def reference_greedy(loaded: LoadedModel, token_ids: list[int], max_tokens: int,
                     ignore_eos: bool = False) -> list[int]:
    """transformers' own greedy generate() (stops after EOS like the server, unless ignore_eos)."""
    ids = torch.tensor([token_ids])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                min_new_tokens=max_tokens if ignore_eos else None, do_sample=False,
                                pad_token_id=loaded.tokenizer.pad_token_id or 0)
    return out[0, len(token_ids):].tolist()
