"""The workloads of `kvtier bench compare` (experiments A-D) and their sizes.

Every preset sends reproducible token-id prompts (the same seed gives every scenario the same
requests; different presets never share a prefix) and has a cold and a warm round:

- A (:class:`Repeated`): one long prompt once, then repeated;
- B (:class:`Conversation`): each turn = previous prompt + previous answer + new user tokens;
  the warm round replays the prompts of the cold one;
- C (:class:`MixedLoad`): an endless stream of new prompts and continuations, sent at a fixed
  concurrency for a fixed time; the warm round goes on with the same stream;
- D (:class:`Repeated`): short prompts with long answers, once, then again.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvtier_tools.bench.load import CompleteFn, Record, Request, run_requests
from kvtier_tools.bench.servers import random_tokens

PRESETS = ("A", "B", "C", "D")


@dataclass(frozen=True)
class Sizes:
    """Workload sizes (tokens, seconds). :data:`FULL` is what docs/benchmarks.md reports."""

    a_tokens: int = 8192
    a_repeats: int = 3
    a_output: int = 32
    b_first_tokens: int = 2048
    b_user_tokens: int = 512
    b_turns: int = 6
    b_output: int = 32
    c_new_tokens: int = 2048
    c_turn_tokens: int = 256
    c_max_tokens: int = 6144  # a session that reached it gets no more turns
    c_new_share: float = 0.2
    c_output: int = 16
    c_inflight: int = 4
    c_cold_s: float = 8.0
    c_warm_s: float = 16.0
    d_tokens: int = 1024
    d_prompts: int = 4
    d_output: int = 256
    sweep_requests: int = 120

    def longest_prompt(self, presets: Iterable[str]) -> int:
        b_last = self.b_first_tokens + (self.b_turns - 1) * (self.b_output + self.b_user_tokens)
        longest = {"A": self.a_tokens, "B": b_last, "C": self.c_max_tokens, "D": self.d_tokens}
        return max(longest[p] for p in presets)


FULL = Sizes()
SMOKE = Sizes(
    a_tokens=4096,
    a_repeats=2,
    a_output=8,
    b_first_tokens=512,
    b_user_tokens=256,
    b_turns=3,
    b_output=8,
    c_new_tokens=1024,
    c_max_tokens=2048,
    c_output=8,
    c_inflight=2,
    c_cold_s=1.0,
    c_warm_s=2.0,
    d_tokens=512,
    d_prompts=1,
    d_output=32,
    sweep_requests=0,
)


class Preset(Protocol):
    """A workload: ``run`` sends one round (``cold`` or ``warm``) through ``complete``."""

    key: str

    def run(self, round_name: str, complete: CompleteFn) -> list[Record]: ...


class Repeated:
    """A and D: each prompt once in the cold round, ``repeats`` times in the warm round."""

    def __init__(self, key: str, prompts: list[list[int]], repeats: int, output_len: int) -> None:
        self.key, self.prompts, self.repeats, self.output_len = key, prompts, repeats, output_len

    def run(self, round_name: str, complete: CompleteFn) -> list[Record]:
        copies, kind = (1, "first") if round_name == "cold" else (self.repeats, "repeat")
        requests = [
            Request(round_name, f"prompt-{i}", kind, p)
            for _ in range(copies)
            for i, p in enumerate(self.prompts)
        ]
        return run_requests(
            complete,
            requests,
            output_len=self.output_len,
            label=f"{self.key} {round_name}",
            total=len(requests),
        )


def next_turn(prompt: Sequence[int], answer: Sequence[int], user: Sequence[int]) -> list[int]:
    """B's next prompt: the conversation so far, the model's answer, the user's new message."""
    return [*prompt, *answer, *user]


class Conversation:
    """B: turns sent one after the other, each built from the previous answer (cold round);
    the warm round replays the prompts the cold round sent."""

    key = "B"

    def __init__(self, sizes: Sizes, seed: int) -> None:
        self.first = random_tokens(sizes.b_first_tokens, f"B:{seed}:first")
        self.user = [
            random_tokens(sizes.b_user_tokens, f"B:{seed}:user:{t}") for t in range(sizes.b_turns)
        ]
        self.turns, self.output_len = sizes.b_turns, sizes.b_output
        self.sent: list[list[int]] = []

    def _turns(self, answers: list[tuple[int, ...]]) -> Iterator[Request]:
        prompt = self.first
        for turn in range(self.turns):
            if turn:
                prompt = next_turn(prompt, answers[-1], self.user[turn])
            self.sent.append(prompt)
            yield Request("cold", f"turn-{turn + 1}", "continuation" if turn else "first", prompt)

    def run(self, round_name: str, complete: CompleteFn) -> list[Record]:
        answers: list[tuple[int, ...]] = []
        if round_name == "cold":
            requests: Iterable[Request] = self._turns(answers)
        else:
            requests = [
                Request(round_name, f"turn-{t + 1}", "repeat", p) for t, p in enumerate(self.sent)
            ]
        return run_requests(
            complete,
            requests,
            output_len=self.output_len,
            label=f"B {round_name}",
            total=self.turns,
            on_record=lambda r: answers.append(r.output_ids),  # read by the next turn
        )


class MixedLoad:
    """C: an endless, reproducible stream. A request opens a new session (share
    ``c_new_share``, or when every session is full) or continues a random open one: that
    session's last prompt plus ``c_turn_tokens`` new tokens. Answers are not appended, so every
    scenario sends the same requests whatever the model says."""

    key = "C"

    def __init__(self, sizes: Sizes, seed: int) -> None:
        self.sizes, self.seed = sizes, seed
        self.rng = random.Random(f"C:{seed}")
        self.sessions: list[list[int]] = []  # the last prompt of each session

    def stream(self, round_name: str) -> Iterator[Request]:
        s = self.sizes
        while True:
            open_sessions = [
                i for i, p in enumerate(self.sessions) if len(p) + s.c_turn_tokens <= s.c_max_tokens
            ]
            if not open_sessions or self.rng.random() < s.c_new_share:
                n = len(self.sessions)
                self.sessions.append(random_tokens(s.c_new_tokens, f"C:{self.seed}:{n}"))
                yield Request(round_name, f"s-{n}", "first", self.sessions[n])
            else:
                i = self.rng.choice(open_sessions)
                turn = random_tokens(s.c_turn_tokens, f"C:{self.seed}:{i}:{len(self.sessions[i])}")
                self.sessions[i] = self.sessions[i] + turn
                yield Request(round_name, f"s-{i}", "continuation", self.sessions[i])

    def run(self, round_name: str, complete: CompleteFn) -> list[Record]:
        s = self.sizes
        return run_requests(
            complete,
            self.stream(round_name),
            output_len=s.c_output,
            inflight=s.c_inflight,
            duration=s.c_cold_s if round_name == "cold" else s.c_warm_s,
            label=f"C {round_name}",
        )


def make_presets(keys: Sequence[str], sizes: Sizes, seed: int) -> dict[str, Preset]:
    """Fresh presets (B and C keep state between their rounds); the same seed gives every
    scenario the same prompts, and different presets never share a prefix."""
    a = [random_tokens(sizes.a_tokens, f"A:{seed}")]
    d = [random_tokens(sizes.d_tokens, f"D:{seed}:{i}") for i in range(sizes.d_prompts)]
    made: dict[str, Preset] = {
        "A": Repeated("A", a, sizes.a_repeats, sizes.a_output),
        "B": Conversation(sizes, seed),
        "C": MixedLoad(sizes, seed),
        "D": Repeated("D", d, 1, sizes.d_output),
    }
    return {k: made[k] for k in keys}
