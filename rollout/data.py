"""Prompts in, with a position that survives a restart: no prompt lost, none repeated."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


@dataclass
class PromptItem:
    index: int           # position in the epoch order: (epoch, index) names a draw exactly
    prompt: str | list[dict]    # text, or chat messages [{"role": ..., "content": ...}]
    label: Any
    metadata: dict


class PromptSource:
    """Items `{"prompt": str | messages, "answer": ...}` in a shuffled order per epoch, reproducible from
    the seed. An item's other fields (data_source, extra_info) become the sample's metadata."""

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


def prompt_ids(tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """A prompt's token ids as the servers get them: through the chat template (text as one user
    turn, or the prompt's own messages; generation prompt added) or as plain text without special
    tokens."""
    if isinstance(prompt, str) and not chat:
        return tokenizer(prompt, add_special_tokens=False).input_ids
    ids = tokenizer.apply_chat_template(chat_messages(prompt, tokenizer, chat), add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_messages(prompt: str | list[dict], tokenizer, chat: bool) -> list[dict]:
    """The messages of a prompt; a clear error for a message list that cannot be templated."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt is {type(prompt).__name__} {str(prompt)[:60]!r}: expected text or a list of "
                         f"chat messages; check task.prompt_key")
    if not chat:
        raise ValueError("a prompt is a list of chat messages, which needs the chat template: "
                         + ("set rollout.use_chat_template=auto" if getattr(tokenizer, "chat_template", None) else
                            "the model's tokenizer has none; use a model with one, or prompts as text"))
    bad = next((i for i, m in enumerate(prompt) if not (isinstance(m, dict) and "role" in m and "content" in m)), None)
    if bad is not None:
        raise ValueError(f"prompt message {bad} is {prompt[bad]!r}: a chat message is a dict with 'role' and 'content'")
    return list(prompt)
