"""Prompts in, with a position that survives a restart: no prompt lost, none repeated."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class PromptItem:
    index: int           # position in the epoch order: (epoch, index) names a draw exactly
    prompt: str
    label: Any
    metadata: dict


class PromptSource:
    """Items `{"prompt": str, "answer": ...}` in a shuffled order per epoch, reproducible from the seed."""

    def __init__(self, items: list[dict], seed: int = 0, shuffle: bool = True, prompt_key: str = "prompt",
                 label_key: str = "answer"):
        if not items:
            raise ValueError("the prompt source is empty")
        missing = next((i for i, it in enumerate(items) if prompt_key not in it), None)
        if missing is not None:
            raise ValueError(f"item {missing} has no {prompt_key!r} field: {sorted(items[missing])}")
        self.items, self.seed, self.shuffle = items, seed, shuffle
        self.prompt_key, self.label_key = prompt_key, label_key
        self.epoch, self.cursor = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> list[int]:
        order = list(range(len(self.items)))
        if self.shuffle:
            random.Random(self.seed * 100003 + self.epoch).shuffle(order)
        return order

    def next(self) -> PromptItem:
        if self.cursor >= len(self._order):
            self.epoch, self.cursor = self.epoch + 1, 0
            self._order = self._make_order()
        i = self._order[self.cursor]
        self.cursor += 1
        item = self.items[i]
        meta = {k: v for k, v in item.items() if k not in (self.prompt_key, self.label_key)}
        return PromptItem(self.epoch * len(self.items) + self.cursor - 1, item[self.prompt_key],
                          item.get(self.label_key), {**meta, "item": i, "epoch": self.epoch})

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.items)}

    def load_state_dict(self, state: dict) -> None:
        if state["size"] != len(self.items):
            raise ValueError(f"saved data position is for {state['size']} items; this source has {len(self.items)}")
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self._order = self._make_order()


def prompt_ids(tokenizer, prompt: str, chat: bool) -> list[int]:
    """A prompt's token ids as the servers get them: through the chat template (one user turn,
    generation prompt added) or as plain text without special tokens."""
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(prompt, add_special_tokens=False).input_ids
