"""models/chat_template.py's own contract, apart from a tokenizer."""

from __future__ import annotations

import pytest

from blockserve.models.chat_template import NOT_RENDERED, render

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ documents }}"


def test_render_refuses_the_options_it_does_not_render():
    """Documents, continuing a final message, assistant-token masks...: a ValueError naming them from
    `render` itself (the Hermes tool probe calls it directly), never a variable silently rendered."""
    messages = [{"role": "user", "content": "hi"}]
    assert render(TEMPLATE, messages) == "<user>hi"
    assert render(TEMPLATE, messages, enable_thinking=False) == "<user>hi"  # the caller's own variables pass
    for name in sorted(NOT_RENDERED):
        with pytest.raises(ValueError, match=f"does not take {name}"):
            render(TEMPLATE, messages, **{name: [{"title": "t", "text": "x"}]})
