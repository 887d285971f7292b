"""Markdown rendering: code highlighting with a copy link per block, raw HTML shown as text,
an unterminated fence (mid-stream) still drawn as code."""
from __future__ import annotations

from app.render import code_blocks, render_markdown


def test_code_blocks_are_highlighted_with_copy_links():
    text = "Intro **bold**\n\n```python\ndef f(x):\n    return x < 2\n```\n\nthen\n\n~~~\nplain\n~~~\n"
    out = render_markdown(text, copy_prefix="copy:7:")
    assert "<strong>bold</strong>" in out
    assert 'href="copy:7:0"' in out and 'href="copy:7:1"' in out
    assert "<span style=" in out                 # pygments inline colours
    assert "&lt;" in out and "return" in out
    blocks = code_blocks(text)
    assert [b.code for b in blocks] == ["def f(x):\n    return x < 2", "plain"]
    assert blocks[0].lang == "python" and all(b.closed for b in blocks)


def test_raw_html_is_not_interpreted():
    out = render_markdown("<b>hi</b> <img src=http://x/y.png> and `a<b`")
    assert "<b>" not in out and "<img" not in out
    assert "&lt;b&gt;hi&lt;/b&gt;" in out


def test_unterminated_fence_while_streaming():
    text = "Here:\n```js\nconsole.log(1)\nconsole.lo"
    blocks = code_blocks(text)
    assert len(blocks) == 1 and not blocks[0].closed and blocks[0].code.endswith("console.lo")
    assert 'href="copy:0"' in render_markdown(text)
    # the fence line itself still arriving: already drawn as a (empty) code block, not as text
    partial = code_blocks("Here:\n```pyt")
    assert len(partial) == 1 and partial[0].code == "" and "```" not in render_markdown("Here:\n```pyt")
