"""Markdown to the HTML subset Qt's rich-text engine draws (QTextBrowser), with highlighted code.

Why not a web view: QtWebEngine is a browser (hundreds of MB) for what Qt's own rich text does
well enough: paragraphs, lists, tables, bold, links, and preformatted code with inline colours.
Fenced code blocks are cut out before Markdown runs (so an unterminated fence while tokens are
still streaming renders as code, not as a mess), highlighted with Pygments using inline styles,
and given a "Copy" link `copy:<n>`; `code_blocks(text)[n]` is what that link copies.
Raw HTML in messages is shown as text, never interpreted.
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

_FENCE = re.compile(r"^(?P<indent>[ \t]{0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+#.-]*)[^\n`]*(?:\n|\Z)", re.M)
_PLACEHOLDER = "\u2063CODEBLOCK{}\u2063"


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


def code_blocks(text: str) -> list[CodeBlock]:
    return split_code_blocks(text)[1]


class _NoRawHtml(markdown.Extension):
    def extendMarkdown(self, md):
        md.preprocessors.deregister("html_block")
        md.inlinePatterns.deregister("html")


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
    rendered = _md().convert(body)
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
