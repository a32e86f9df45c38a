"""`TITOTokenizer`: chat-template rendering as ids, observation deltas, and what a template-faithful model emits."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from miles.tito.errors import (
    DeltaPrefixError,
    TemplateDropsToolsError,
    TemplateTokenizerMismatchError,
)
from miles.tito.families import FamilyHandler, detect_family, get_handler, template_source
from miles.tito.loading import load_tokenizer
from miles.tito.spec import TokenizerSpec, resolve_chat_template, template_sha256
from miles.types import Message

MessageLike = Message | dict[str, Any]


def as_dicts(messages: Sequence[MessageLike]) -> list[dict[str, Any]]:
    """Messages in the dict form chat templates take; tool-call arguments keep their original JSON text."""
    return [m.to_dict(verbatim=True) if isinstance(m, Message) else dict(m) for m in messages]


class TITOTokenizer:
    """Token-in, token-out rendering around an HF tokenizer and its chat template.

    `family` is detected from the template unless given ("chatml", "qwen3", "llama3", "tiny").
    `chat_template` overrides the tokenizer's template; `chat_template_kwargs` (e.g. `enable_thinking`) are
    passed to every render.
    """

    #: The names that rebuild this tokenizer, when `from_spec` made it (sessions record it).
    spec: TokenizerSpec | None = None

    @classmethod
    def from_spec(cls, spec: TokenizerSpec) -> TITOTokenizer:
        """The TITO tokenizer `spec` names; its `spec` is `spec` with `template_sha256` filled in."""
        tito = cls(
            load_tokenizer(spec.tokenizer),
            chat_template=resolve_chat_template(spec.chat_template),
            chat_template_kwargs=dict(spec.chat_template_kwargs),
        )
        tito.spec = dataclasses.replace(
            spec,
            chat_template_kwargs=dict(spec.chat_template_kwargs),
            template_sha256=template_sha256(tito.chat_template),
        )
        return tito

    def __init__(
        self,
        tokenizer: Any,
        family: str | None = None,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = template_source(tokenizer, chat_template)
        if not self.chat_template:
            detect_family(tokenizer, chat_template)  # raises the named error
        self.family = family if family is not None else detect_family(tokenizer, chat_template)
        self.handler: FamilyHandler = get_handler(self.family)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        vocab = tokenizer.get_vocab()
        self.vocab_size = len(tokenizer)
        self.stop_token_ids: tuple[int, ...] = tuple(vocab[t] for t in self.handler.stop_tokens if t in vocab)
        if self.handler.close_token not in vocab:
            raise TemplateTokenizerMismatchError(
                f"the chat template is a {self.family} template, but the tokenizer lacks its turn-closing token "
                f"{self.handler.close_token!r}: use a template of this tokenizer's family"
            )
        self.close_token_id: int = vocab[self.handler.close_token]
        self._stop_set = frozenset(self.stop_token_ids)
        self.special_ids: set[int] = set(tokenizer.all_special_ids)
        for idx, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                self.special_ids.add(int(idx))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode_fast = (
            (lambda text: backend.encode(text, add_special_tokens=False).ids) if backend else None
        )
        self._base_ids: list[int] | None = None

    def __repr__(self) -> str:
        return f"TITOTokenizer(family={self.family!r}, tokenizer={getattr(self.tokenizer, 'name_or_path', '')!r})"

    # rendering -------------------------------------------------------------------------------------------

    def render_text(
        self,
        messages: Sequence[MessageLike],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text for `messages` (and tool schemas)."""
        return self.tokenizer.apply_chat_template(
            as_dicts(messages),
            tools=tools or None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.chat_template_kwargs,
        )

    def check_renders_tools(self, messages: Sequence[MessageLike], tools: list[dict] | None) -> None:
        """`TemplateDropsToolsError` unless the chat template shows `tools` to the model: the prompt of
        `messages` must differ with and without them, and name every tool. No tools: nothing to check."""
        if not tools:
            return
        with_tools = self.render_text(messages, tools, add_generation_prompt=True)
        without = self.render_text(messages, None, add_generation_prompt=True)
        names = [str((t.get("function") or t).get("name") or "") for t in tools]
        missing = [n for n in names if n and n not in with_tools]
        if with_tools != without and not missing:
            return
        fix = {"llama3": "llama3-tools"}.get(self.family, "chatml-tools")
        what = (
            "renders the prompt the same with and without its tool schemas"
            if with_tools == without
            else f"leaves out {len(missing)} of the {len(names)} tools ({', '.join(missing[:3])})"
        )
        name = self.spec.tokenizer if self.spec is not None else getattr(self.tokenizer, "name_or_path", "")
        raise TemplateDropsToolsError(
            f"the chat template of tokenizer {name!r} {what}, so "
            f"the model would never see its tools: set model.chat_template: {fix} (or a .jinja file that renders "
            "`tools`)"
        )

    def encode(self, text: str) -> list[int]:
        """Ids of `text` with no BOS/EOS added (templates write their own)."""
        if self._encode_fast is not None:
            return list(self._encode_fast(text))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_ids(
        self,
        messages: Sequence[MessageLike],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = False,
    ) -> list[int]:
        """`encode(render_text(...))`: the canonical ids of a conversation."""
        return self.encode(self.render_text(messages, tools, add_generation_prompt=add_generation_prompt))

    def is_stop(self, token_id: int) -> bool:
        return token_id in self._stop_set

    def cut_after_last_stop(self, ids: list[int]) -> list[int]:
        """`ids` up to and including the last stop token (all of `ids` when there is none)."""
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] in self._stop_set:
                return ids[: i + 1]
        return ids

    # deltas ------------------------------------------------------------------------------------------------

    def _delta_base_ids(self) -> list[int]:
        if self._base_ids is None:
            self._base_ids = self.render_ids(list(self.handler.delta_base))
        return self._base_ids

    def observation_delta(self, observation: Sequence[MessageLike]) -> list[int]:
        """Ids that follow an assistant turn's stop token: `observation` and the next generation prompt.

        Renders the family's fixed base conversation with and without `observation`, asserts that the short
        render is a token prefix of the long one (`DeltaPrefixError` otherwise), and returns the suffix after
        the base's last stop token.
        """
        base = self._delta_base_ids()
        full = self.render_ids(
            list(self.handler.delta_base) + as_dicts(observation), add_generation_prompt=True
        )
        if full[: len(base)] != base:
            raise DeltaPrefixError(
                f"{self.family}: rendering the base conversation with {len(observation)} more message(s) changes "
                f"its tokens; the template is not append-only for "
                f"{json.dumps([m.get('role') for m in as_dicts(observation)])}"
            )
        cut = len(self.cut_after_last_stop(base))
        return full[cut:]

    def generation_prompt_ids(self) -> list[int]:
        """What the template adds after a closed turn to open the next assistant turn (no messages between)."""
        return self.observation_delta([])

    def expected_generation(
        self, history: Sequence[MessageLike], assistant: MessageLike, tools: list[dict] | None = None
    ) -> list[int]:
        """The ids a model that follows the template exactly would generate for `assistant` after `history`.

        The template's text for the assistant turn, up to and including its stop token.
        """
        prompt = self.render_text(history, tools, add_generation_prompt=True)
        full = self.render_text(list(history) + [assistant], tools)
        if not full.startswith(prompt):
            raise DeltaPrefixError(
                f"{self.family}: the generation prompt is not a prefix of the rendered "
                "assistant turn; the template is not append-only there"
            )
        return self.cut_after_last_stop(self.encode(full[len(prompt) :]))
