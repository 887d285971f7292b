"""Markdown to the HTML subset Qt's rich-text engine draws (QTextBrowser), with highlighted code.

Why not a web view: QtWebEngine is a browser (hundreds of MB) for what Qt's own rich text does
well enough: paragraphs, lists, tables, bold, links, and preformatted code with inline colours.
Fenced code blocks are cut out before Markdown runs (so an unterminated fence while tokens are
still streaming renders as code, not as a mess), highlighted with Pygments using inline styles,
and given a "Copy" link `copy:<n>`; `code_blocks(text)[n]` is what that link copies.
Raw HTML in messages is shown as text, never interpreted.

LaTeX math ($...$, \\(...\\), $$...$$, \\[...\\]) is cut out the same way, after the code blocks and
outside code spans, so Markdown never sees its underscores and backslashes; app/math_text.py turns
it into Unicode with scripts. A lone `$` is money, not math: like Pandoc, an opening `$` must be
followed by a non-space, a closing one preceded by a non-space and not followed by a digit.
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

import markdown
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name, guess_lexer
from pygments.util import ClassNotFound

from app.math_text import MATH_FONTS, MathError, latex_to_html

_FENCE = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n`]*(?:\n|\Z)", re.M)
_PLACEHOLDER = "\u2063CODEBLOCK{}\u2063"
_MATH_PLACEHOLDER = "\u2063MATH{}\u2063"
# Alternatives in priority order at one position: a code span (skipped), an escaped dollar
# (skipped; Markdown unescapes it), display math, inline math.
_MATH = re.compile(
    r"(?P<code>(?P<ticks>`+).+?(?<!`)(?P=ticks)(?!`))"
    r"|(?P<escaped>\\\$)"
    r"|\$\$(?P<dd>.+?)\$\$"
    r"|\\\[(?P<db>.+?)\\\]"
    r"|\\\((?P<ip>.+?)\\\)"
    r"|\$(?P<id>[^\s$](?:[^$\n\\]|\\.|\n(?![ \t]*\n))*?)(?<![\s\\])\$(?!\d)",
    re.S)


@dataclass
class CodeBlock:
    lang: str
    code: str
    closed: bool


def split_code_blocks(text: str) -> tuple[str, list[CodeBlock]]:
    """Replace fenced code blocks with placeholders; an open fence runs to the end of the text."""
    blocks: list[CodeBlock] = []
    out: list[str] = []
    pos = 0
    while True:
        m = _FENCE.search(text, pos)
        if not m:
            out.append(text[pos:])
            break
        out.append(text[pos:m.start()])
        fence = m.group("fence")
        close = re.compile(r"^[ \t]{0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}[ \t]*$", re.M)
        c = close.search(text, m.end())
        if c:
            code, pos, closed = text[m.end():c.start()], c.end(), True
        else:
            code, pos, closed = text[m.end():], len(text), False
        blocks.append(CodeBlock(m.group("lang"), code.rstrip("\n"), closed))
        out.append("\n\n" + _PLACEHOLDER.format(len(blocks) - 1) + "\n\n")
        if not closed:
            break
    return "".join(out), blocks


@dataclass
class Math:
    tex: str
    display: bool
    source: str          # as written, delimiters included: the fallback when it does not parse


def split_math(text: str) -> tuple[str, list[Math]]:
    """Replace math outside code spans with placeholders. Display math that fills its own lines
    becomes its own paragraph so it can be centred."""
    found: list[Math] = []

    def swap(m: re.Match) -> str:
        if m.group("code") or m.group("escaped"):
            return m.group(0)
        display = m.group("dd") is not None or m.group("db") is not None
        tex = next(g for g in (m.group("dd"), m.group("db"), m.group("ip"), m.group("id")) if g is not None)
        if not tex.strip():
            return m.group(0)
        found.append(Math(tex.strip(), display, m.group(0)))
        ph = _MATH_PLACEHOLDER.format(len(found) - 1)
        line_start = m.start() == 0 or text[m.start() - 1] == "\n"
        line_end = m.end() == len(text) or text[m.end()] == "\n"
        return f"\n\n{ph}\n\n" if display and line_start and line_end else ph

    return _MATH.sub(swap, text), found


def math_html(item: Math, block: bool = False) -> str:
    """The math in a serif math face; the source in monospace when it cannot be converted.
    `block`: display math alone on its line, whose matrix rows may take a line each."""
    try:
        inner = latex_to_html(item.tex, block)
    except MathError:
        return f"<code>{html.escape(item.source)}</code>"
    size = " font-size:large;" if item.display else ""
    return f'<span style="font-family:{MATH_FONTS};{size}">{inner}</span>'


def code_blocks(text: str) -> list[CodeBlock]:
    return split_code_blocks(text)[1]


class _NoRawHtml(markdown.Extension):
    def extendMarkdown(self, md):
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")


_LIST_ITEM = re.compile(r"^(?P<indent> *)(?P<marker>[-*+]|\d{1,9}[.)])(?P<gap> +|$)")


def normalize_list_indent(text: str) -> str:
    """Models indent nested list items by 2 or 3 spaces (CommonMark: under the parent's text);
    Python-Markdown only nests at 4. Re-indent list items and their continuation lines to 4 per
    level so "1. a\n   - b" nests instead of running into its parent's line."""
    out: list[str] = []
    stack: list[int] = []               # the source indent of the items at each open level
    for line in text.split("\n"):
        m = _LIST_ITEM.match(line)
        if m:
            indent = len(m.group("indent"))
            while stack and indent < stack[-1]:
                stack.pop()
            if not stack or indent > stack[-1]:
                stack.append(indent)
            out.append(" " * (4 * (len(stack) - 1)) + line[indent:])
        elif not line.strip():
            out.append(line)
        elif stack and line.startswith(" "):
            out.append(" " * (4 * len(stack)) + line.lstrip(" "))
        else:
            stack = []
            out.append(line)
    return "\n".join(out)


_LIST_TAG = re.compile(r"<(/?)(ul|ol|li)>")


def _tight_nested_lists(rendered: str) -> str:
    """Qt gives every list a paragraph's margin above and below, and hands the outer list's bottom
    margin to the item just before a sub-list, which then floats away from its parent. Nested lists
    get no margins and outer ones none below (what follows brings its own top margin)."""
    depth = 0

    def fix(m: re.Match) -> str:
        nonlocal depth
        closing, tag = m.group(1), m.group(2)
        if tag == "li":
            depth += -1 if closing else 1
        elif not closing and depth > 0:
            return f'<{tag} style="margin-top:0px; margin-bottom:0px;">'
        elif not closing:
            return f'<{tag} style="margin-bottom:0px;">'
        return m.group(0)

    return _LIST_TAG.sub(fix, rendered)


def _md() -> markdown.Markdown:
    return markdown.Markdown(extensions=["tables", "sane_lists", _NoRawHtml()])


def _highlight(block: CodeBlock, dark: bool) -> str:
    try:
        lexer = get_lexer_by_name(block.lang) if block.lang else guess_lexer(block.code)
    except ClassNotFound:
        lexer = TextLexer()
    if not block.lang and lexer.analyse_text(block.code) < 0.3:
        lexer = TextLexer()
    fmt = HtmlFormatter(noclasses=True, nowrap=True, style="monokai" if dark else "friendly")
    return highlight(block.code, lexer, fmt)


def render_markdown(text: str, dark: bool = False, copy_prefix: str = "copy:") -> str:
    """HTML for one message. Code blocks get a header row with the language and a Copy link."""
    body, blocks = split_code_blocks(text)
    body, maths = split_math(body)
    rendered = _tight_nested_lists(_md().convert(normalize_list_indent(body)))
    # Qt's headings (h1 at twice the text size) shout in a chat bubble; keep them a step apart.
    for level, size in ((1, "x-large"), (2, "large"), (3, "medium"), (4, "medium")):
        rendered = rendered.replace(f"<h{level}>", f'<h{level} style="font-size:{size};">')
    border = "#4a5059" if dark else "#d0d7de"
    th_bg = "#2a2e35" if dark else "#eef1f5"
    rendered = rendered.replace(
        "<table>", f'<table border="1" cellspacing="0" cellpadding="5" '
                   f'style="border-collapse: collapse; border-color: {border}; margin: 6px 0;">')
    rendered = rendered.replace("<th>", f'<th bgcolor="{th_bg}">').replace("<th style=", f'<th bgcolor="{th_bg}" style=')
    for i, item in enumerate(maths):
        ph = _MATH_PLACEHOLDER.format(i)
        if item.display:
            rendered = rendered.replace(f"<p>{ph}</p>", f'<p align="center">{math_html(item, block=True)}</p>')
        rendered = rendered.replace(ph, math_html(item))
    # Qt's rich text draws <code> in the body font; name the face and shade it so that a code
    # span reads as code (blocks are <pre>, inserted below, and untouched).
    span_bg = "#3a3f48" if dark else "#e4e7eb"  # shows on both bubbles
    rendered = rendered.replace("<code>", f'<code style="font-family:monospace; background-color:{span_bg};">')
    bg = "#272822" if dark else "#f4f5f7"
    fg = "#f8f8f2" if dark else "#1f2328"
    head = "#9aa0a6" if dark else "#57606a"
    for i, block in enumerate(blocks):
        code = _highlight(block, dark).rstrip("\n")
        lang = html.escape(block.lang or "code")
        table = (f'<table width="100%" cellspacing="0" cellpadding="8" bgcolor="{bg}" style="margin: 6px 0;">'
                 f'<tr><td><span style="color:{head}; font-size:small;">{lang}</span>'
                 f'&nbsp;&nbsp;<a href="{copy_prefix}{i}" style="font-size:small;">Copy</a>'
                 f'<pre style="color:{fg}; margin:4px 0 0 0;">{code}</pre></td></tr></table>')
        ph = _PLACEHOLDER.format(i)
        rendered = rendered.replace(f"<p>{ph}</p>", table).replace(ph, table)
    return rendered
