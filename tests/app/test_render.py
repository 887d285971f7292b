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


# ---------------------------------------------------------------- LaTeX math
def test_inline_math_becomes_unicode_with_scripts():
    from app.math_text import MATH_FONTS
    out = render_markdown(r"Euler: $e^{i\pi} + 1 = 0$, and \(\alpha_1 \leq \beta\).")
    assert MATH_FONTS.split(",")[0] in out                     # drawn in the math face
    assert "π" in out and "α" in out and "≤" in out and "β" in out
    assert "<sup><i>i</i><i>π</i></sup>" in out                # the whole group is the exponent
    assert "<sub>1</sub>" in out
    assert "\\pi" not in out and "\\alpha" not in out and "$" not in out


def test_fractions_roots_and_scripts_read_correctly():
    from app.math_text import latex_to_html
    assert latex_to_html(r"\frac{a+b}{2}") == "(<i>a</i>+<i>b</i>)/2"
    assert latex_to_html(r"\frac{1}{n}") == "1/<i>n</i>"
    assert latex_to_html(r"\frac{1}{2a}") == "1/(2<i>a</i>)"          # not (1/2)·a
    assert latex_to_html(r"\frac{x^2}{y_i}") == "<i>x</i><sup>2</sup>/<i>y</i><sub><i>i</i></sub>"
    assert latex_to_html(r"\sqrt{x^2+1}") == "√(<i>x</i><sup>2</sup>+1)"
    assert latex_to_html(r"x^{10}_{ij}") == "<i>x</i><sup>10</sup><sub><i>ij</i></sub>"
    assert latex_to_html(r"\sin x").startswith("sin ")          # function names upright
    assert "\\" not in latex_to_html(r"\int_0^\infty e^{-x}\,dx")


def test_markdown_inside_math_is_left_alone():
    # underscores and stars are TeX here, not emphasis
    out = render_markdown(r"$a_1 * b_2 * c_3$")
    assert "<em>" not in out and "<strong>" not in out
    assert out.count("<sub>") == 3


def test_display_math_is_centred_on_its_own_line():
    out = render_markdown("Sum:\n$$\n\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}\n$$\nso there.")
    assert '<p align="center">' in out
    centred = out.split('<p align="center">', 1)[1].split("</p>", 1)[0]
    assert "∑" in centred and "/2" in centred and "font-size:large" in centred
    assert "Sum:" not in centred and "so there" not in centred
    assert "\\[" not in render_markdown("\\[x^2\\]") and "<sup>2</sup>" in render_markdown("\\[x^2\\]")


def test_code_is_never_math():
    text = "Use `$HOME` and `$x$` here.\n\n```bash\necho \"$a$ and $b$\"\n```\n"
    out = render_markdown(text)
    assert ">$HOME</code>" in out and ">$x$</code>" in out
    assert "$a$ and $b$" in code_blocks(text)[0].code
    assert "<sup>" not in out and "serif" not in out


def test_prices_are_not_math():
    for text in ("It costs $5 and $10.", "Between $5-$10 each", "Pay $20, not $ 30 $", "from $3.50 to $4"):
        out = render_markdown(text)
        assert "serif" not in out, text
        assert out.count("$") == text.count("$"), text
    assert "serif" not in render_markdown(r"Escaped \$x\$ stays text")


def test_math_that_does_not_parse_falls_back_to_source():
    out = render_markdown(r"Broken $\frac{1$ and fine $x^2$")
    assert r">$\frac{1$</code>" in out and "monospace" in out
    assert "<sup>2</sup>" in out


def test_unclosed_math_while_streaming_stays_text():
    out = render_markdown(r"The sum $$\sum_{k=1}")
    assert "serif" not in out and "sum" in out


def test_lists_nested_by_two_or_three_spaces_still_nest():
    out = render_markdown("1. First\n2. Second\n   - nested a\n   - nested b\n3. Third\n\n- x\n  - y\n")
    second = out.split("<li>Second", 1)[1]
    assert second.index("<ul") < second.index("nested a") < second.index("</ul>") < second.index("Third")
    assert out.count("<ul") == 3 and "- nested" not in out and "- y" not in out
    assert out.count('<ul style="margin-top:0px') == 2        # nested ones hug their parent item


def test_tables_get_borders_and_header_shading():
    light = render_markdown("| a | b |\n|---|--:|\n| 1 | 2 |")
    dark = render_markdown("| a | b |\n|---|--:|\n| 1 | 2 |", dark=True)
    assert 'border="1"' in light and 'cellpadding="5"' in light
    assert '<th bgcolor="' in light and light.count("<th bgcolor") == 2
    assert light.split('<th bgcolor="')[1][:7] != dark.split('<th bgcolor="')[1][:7]


def test_matrix_rows_break_only_in_display_blocks():
    matrix = r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"
    alone = render_markdown(f"$${matrix}$$")
    inline = render_markdown(f"Here $${matrix}$$ sits in a sentence.")
    assert '<p align="center">' in alone and "<br>" in alone
    assert "<br>" not in inline and "; " in inline
    assert all(d in alone for d in "1234") and alone.index("1") < alone.index("<br>") < alone.index("3")


def test_code_spans_are_drawn_in_a_fixed_pitch_face(qapp):
    """Qt draws a bare <code> in the body font; the span must come out monospaced and shaded
    (checked in the laid-out document, not in the HTML string)."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QFontInfo, QTextCursor, QTextDocument
    for dark in (False, True):
        doc = QTextDocument()
        doc.setHtml(render_markdown("call `frobnicate()` now", dark=dark))
        text = doc.toPlainText()
        at = text.index("frobnicate")
        cursor = QTextCursor(doc)
        cursor.setPosition(at + 1)
        span = cursor.charFormat()
        cursor.setPosition(text.index("now") + 1)
        body = cursor.charFormat()
        assert QFontInfo(span.font()).fixedPitch() and not QFontInfo(body.font()).fixedPitch()
        assert span.background().style() != Qt.NoBrush and body.background().style() == Qt.NoBrush
