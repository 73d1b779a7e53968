"""Conversations: chat messages as prompts, and MT-bench's second turn as a real conversation."""

from __future__ import annotations

import json

import pytest

from viasd.api import GenerateConfig, generate
from viasd.bench import load_tasks, parse_methods, run_bench
from viasd.errors import UsageError


def test_two_turn_mt_bench_is_a_conversation(smollm2, tmp_path):
    """--turns 2: the second question is asked after the model's own first answer (chat template),
    each method answers both turns, and the record's statistics cover both."""
    prompts = load_tasks("spec_bench:mt_bench", 1, turns=2)
    assert prompts[0].follow_up and prompts[0].follow_up != prompts[0].text
    out = tmp_path / "two.jsonl"
    run_bench(smollm2, None, parse_methods("ar,pld"), prompts, out, GenerateConfig(max_new_tokens=6), progress=False)
    ar, pld = [json.loads(line) for line in out.read_text().splitlines()]
    first, second = ar["turns"]
    conversation = [{"role": "user", "content": prompts[0].text}, {"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": prompts[0].follow_up}]
    again = generate(conversation, smollm2, strategy="ar", max_new_tokens=6, progress=False)
    assert second["token_ids"] == again.token_ids == ar["token_ids"]
    assert second["stats"]["prompt_tokens"] == len(smollm2.encode(conversation)) > first["stats"]["prompt_tokens"] + 6
    assert ar["stats"]["new_tokens"] == first["stats"]["new_tokens"] + second["stats"]["new_tokens"] == 12
    assert ar["stats"]["wall_s"] == pytest.approx(first["stats"]["wall_s"] + second["stats"]["wall_s"], abs=2e-4)
    assert [t["token_ids"] for t in pld["turns"]] == [t["token_ids"] for t in ar["turns"]]  # lossless in both turns


def test_conversation_prompts(tiny):
    """Chat messages are checked; without a chat template their contents are joined by blank lines."""
    conversation = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"}]
    assert tiny.encode(conversation, chat=False) == tiny.encode("w1 w2\n\nw3\n\nw4", chat=False)
    r = generate(conversation, tiny, strategy="ar", max_new_tokens=3, chat=False, progress=False)
    assert r.stats.prompt_tokens == 4
    with pytest.raises(UsageError, match="must end with a user message"):
        generate(conversation[:2], tiny, chat=False, progress=False)
    with pytest.raises(UsageError, match="message 0"):
        generate([{"role": "robot", "content": "w1"}], tiny, chat=False, progress=False)
    with pytest.raises(UsageError, match="message 1"):
        generate([{"role": "user", "content": "w1"}, 5], tiny, chat=False, progress=False)
