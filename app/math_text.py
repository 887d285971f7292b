"""LaTeX math to the rich-text subset Qt draws: Unicode symbols, <sup>/<sub>, italic letters.

Why not real typesetting: Qt's rich text has no math layout and a web engine or a TeX install is
far too heavy for chat. What readers need from `$\\frac{a+b}{2}$` is "(a+b)/2" with proper symbols,
and pylatexenc (pure Python, made for LaTeX → text) already knows hundreds of symbol macros. It
flattens scripts to "x^2", though, so this module walks pylatexenc's parse tree itself: scripts
become <sup>/<sub>, fractions and roots get the parentheses a reader needs, and every other macro
is handed to pylatexenc's own text conversion. Anything that does not parse raises MathError, and
the caller shows the source instead.
"""
from __future__ import annotations

import html
import re
from functools import lru_cache

try:
    from pylatexenc.latex2text import LatexNodes2Text
    from pylatexenc.latexwalker import (LatexCharsNode, LatexCommentNode, LatexEnvironmentNode, LatexGroupNode,
                                        LatexMacroNode, LatexMathNode, LatexSpecialsNode, LatexWalker,
                                        LatexWalkerError)
except ImportError:     # an install without the app extra: the app still runs, math shows as source
    LatexWalker = None

MATH_FONTS = "'STIX Two Math', 'Cambria Math', 'DejaVu Serif', 'Times New Roman', serif"

_TO_TEXT = LatexNodes2Text(math_mode="verbatim", strict_latex_spaces=True) if LatexWalker else None
_UPRIGHT = {"text", "textrm", "textnormal", "mathrm", "operatorname", "mbox", "textup", "mathup"}
_BOLD = {"mathbf", "textbf", "boldsymbol", "bm"}
_FRACS = {"frac", "dfrac", "tfrac", "cfrac"}
# A symbol macro whose text is one of these gets spaces around it (pylatexenc drops them).
_SPACED = set("=≠≈≡≤≥<>≪≫∼≃≅∝∈∉⊂⊃⊆⊇→←↔⇒⇐⇔↦±∓×÷·∘∪∩∧∨⊕⊗")
_ROWS = {"aligned", "align", "align*", "gathered", "gather", "gather*", "split", "eqnarray", "multline",
         "cases", "array", "matrix", "pmatrix", "bmatrix", "Bmatrix", "vmatrix", "Vmatrix", "smallmatrix"}
_BRACKETS = {"pmatrix": "()", "bmatrix": "[]", "Bmatrix": "{}", "vmatrix": "||", "Vmatrix": "‖‖", "cases": "{"}
_LETTERS = re.compile(r"[A-Za-zα-ωϑϕϵϱς]+")


class MathError(ValueError):
    """The LaTeX could not be understood; show the source instead."""


@lru_cache(maxsize=2048)
def latex_to_html(tex: str, block: bool = False) -> str:
    """HTML (no outer element) for the math in `tex`, without its $ or \\( delimiters. Rows of
    matrices and aligned equations go on lines of their own in a `block` (display math on its own
    line), and are separated by semicolons inside a line of text. Cached: while an answer streams,
    its formulas are converted again on every redraw."""
    if LatexWalker is None:
        raise MathError("pylatexenc is not installed")
    try:
        nodes = LatexWalker(tex, tolerant_parsing=False).get_latex_nodes()[0]
        out = _Writer("<br>" if block else "; ").nodes(nodes)
    except LatexWalkerError as e:
        raise MathError(str(e)) from e
    except Exception as e:  # a model can write anything (10 000 nested braces): show the source, never crash
        raise MathError(f"{type(e).__name__}: {e}") from e
    out = _tighten_scripts(re.sub(r"(?:[ \t\r\n]|&nbsp;)+", " ", out).strip())
    return re.sub(r" (<su[bp]>)", r"\1", out) or "&nbsp;"


def _plain(fragment: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", fragment)).strip()


def _without_scripts(fragment: str) -> str:
    return _plain(re.sub(r"<(su[bp])>.*?</\1>", "", fragment))


def _needs_parens(fragment: str) -> bool:
    """Whether a numerator or root argument reads wrong without brackets: it holds an operator
    or a space outside its own brackets (a+b, x y). Scripts do not count (x², a_i)."""
    depth = 0
    for ch in _without_scripts(fragment):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and (ch in "+-−=<>/,·× " or ch in _SPACED):
            return True
    return False


def _wrap(fragment: str) -> str:
    return f"({fragment})" if _needs_parens(fragment) else fragment


def _wrap_denominator(fragment: str) -> str:
    """a/2n reads as (a/2)·n, so a denominator keeps brackets unless it is one number or symbol."""
    text = _without_scripts(fragment)
    simple = len(text) <= 1 or text.replace(".", "").isdigit()
    return fragment if simple else f"({fragment})"


def _tighten_scripts(out: str) -> str:
    """Spaces around = or → are right on the line but waste room in a small sub/superscript."""
    return re.sub(r"<(su[bp])>(.*?)</\1>", lambda m: f"<{m.group(1)}>{m.group(2).replace(' ', '')}</{m.group(1)}>", out)


class _Writer:
    cell_separator = " "     # what & becomes: nothing in aligned equations, a wide gap in matrices

    def __init__(self, row_separator: str):
        self.row_separator = row_separator

    def nodes(self, nodes) -> str:
        out: list[str] = []
        nodes = list(nodes or [])
        i = 0
        while i < len(nodes):
            node = nodes[i]
            if isinstance(node, LatexCharsNode):
                i = self._chars(node.chars, nodes, i, out)
                continue
            out.append(self.node(node))
            i += 1
        return "".join(out)

    def _chars(self, chars: str, nodes, i: int, out: list[str]) -> int:
        """Plain characters; a ^ or _ takes the next character, or the next node when it is the
        last character of this run (x^{2} parses as "x^" followed by the group {2})."""
        pos = 0
        while pos < len(chars):
            ch = chars[pos]
            if ch in "^_":
                tag = "sup" if ch == "^" else "sub"
                if pos + 1 < len(chars):
                    rest = chars[pos + 1:].lstrip()
                    if not rest:
                        pos = len(chars) - 1
                        continue
                    skip = len(chars[pos + 1:]) - len(rest)
                    out.append(f"<{tag}>{self.text(rest[0])}</{tag}>")
                    pos += 2 + skip
                    continue
                if i + 1 >= len(nodes):
                    raise MathError(f"nothing after {ch}")
                out.append(f"<{tag}>{self.node(nodes[i + 1])}</{tag}>")
                return i + 2
            j = pos
            while j < len(chars) and chars[j] not in "^_":
                j += 1
            out.append(self.text(chars[pos:j]))
            pos = j
        return i + 1

    def text(self, s: str, italic: bool = True) -> str:
        s = s.replace("-", "−").replace("'", "′").replace("*", "∗")
        pieces, last = [], 0
        for m in _LETTERS.finditer(s) if italic else ():
            pieces.append(self._spaced(s[last:m.start()]))
            pieces.append(f"<i>{html.escape(m.group())}</i>")
            last = m.end()
        pieces.append(self._spaced(s[last:]))
        return "".join(pieces)

    @staticmethod
    def _spaced(s: str) -> str:
        return "".join(f" {html.escape(c)} " if c in _SPACED else html.escape(c) for c in s)

    def node(self, node) -> str:
        if isinstance(node, LatexCharsNode):
            return self.nodes([node])
        if isinstance(node, LatexGroupNode):
            return self.nodes(node.nodelist)
        if isinstance(node, LatexCommentNode):
            return ""
        if isinstance(node, LatexMathNode):
            return self.nodes(node.nodelist)
        if isinstance(node, LatexSpecialsNode):
            if node.specials_chars == "&":
                return self.cell_separator
            return " " if node.specials_chars == "~" else html.escape(_TO_TEXT.nodelist_to_text([node]))
        if isinstance(node, LatexMacroNode):
            return self._macro(node)
        if isinstance(node, LatexEnvironmentNode):
            return self._environment(node)
        return html.escape(_TO_TEXT.nodelist_to_text([node]))

    def _args(self, node) -> list:
        argd = getattr(node, "nodeargd", None)
        return list(argd.argnlist) if argd is not None and argd.argnlist else []

    def _macro(self, node: LatexMacroNode) -> str:
        name, args = node.macroname, self._args(node)
        if name in _FRACS or name == "over":
            if len(args) < 2 or args[-1] is None or args[-2] is None:
                raise MathError("\\frac needs two arguments")
            num, den = self.node(args[-2]), self.node(args[-1])
            return f"{_wrap(num)}/{_wrap_denominator(den)}"
        if name == "binom" and len(args) == 2:
            return f"C({self.node(args[0])}, {self.node(args[1])})"
        if name == "sqrt":
            if not args or args[-1] is None:
                raise MathError("\\sqrt needs an argument")
            inner = self.node(args[-1])
            index = f"<sup>{self.node(args[0])}</sup>" if len(args) > 1 and args[0] is not None else ""
            return f"{index}√({inner})" if len(_plain(inner)) > 1 else f"{index}√{inner}"
        if name in _UPRIGHT and args and args[-1] is not None:
            return self._upright(args[-1])
        if name in ("overline", "underline") and args and args[-1] is not None:
            return f'<span style="text-decoration: {name}">{self.node(args[-1])}</span>'
        if name in _BOLD and args and args[-1] is not None:
            return f"<b>{self.node(args[-1])}</b>"
        if name in ("left", "right", "big", "Big", "bigg", "Bigg", "bigl", "bigr", "Bigl", "Bigr", "displaystyle",
                    "textstyle", "limits", "nolimits"):
            return ""
        if name == "\\":
            return self.row_separator
        text = _TO_TEXT.nodelist_to_text([node])
        if len(text) > 1 and text.isalpha():        # \sin, \log, \lim: upright, then a space
            return html.escape(text) + " "
        space = " " if getattr(node, "macro_post_space", "") else ""     # "\alpha + x" keeps its spaces
        if len(text) == 1 and _LETTERS.fullmatch(text):    # \alpha is a variable like x: italic
            return self.text(text) + space
        return self._spaced(text.replace("-", "−")) + space

    def _upright(self, arg) -> str:
        if isinstance(arg, LatexGroupNode):
            return "".join(self.text(n.chars, italic=False) if isinstance(n, LatexCharsNode) else self.node(n)
                           for n in arg.nodelist)
        return self.node(arg)

    def _environment(self, node: LatexEnvironmentNode) -> str:
        """Aligned equations, cases and matrices: one line per row, cells separated by spaces;
        a matrix row keeps its brackets so a reader sees the shape."""
        name = node.environmentname
        if name not in _ROWS:
            return html.escape(_TO_TEXT.nodelist_to_text([node]))
        aligned = name.startswith(("align", "gather", "split", "eqnarray", "multline"))
        outer, self.cell_separator = self.cell_separator, ("" if aligned else "\u2003")
        rows: list[list] = [[]]
        for child in node.nodelist:
            if isinstance(child, LatexMacroNode) and child.macroname == "\\":
                rows.append([])
            else:
                rows[-1].append(child)
        try:
            lines = [self.nodes(r) for r in rows]
        finally:
            self.cell_separator = outer
        lines = [re.sub(r"[ \t\r\n]+", " ", line).strip(" ") for line in lines]
        lines = [line for line in lines if line]
        brackets = _BRACKETS.get(name)
        if brackets and len(brackets) == 2:
            lines = [f"{brackets[0]} {line} {brackets[1]}" for line in lines]
        elif brackets:
            lines = [f"{brackets} {line}" for line in lines]
        return self.row_separator.join(lines)
