"""Kernel text -> C++: the light rewrite of MSL for ``msl_shim.h``.

Each SIMD or barrier call gets its call-site id (for error messages and for
checking that all lanes are at the same call), ``threadgroup`` declarations
become storage shared by the threadgroup, ``1.0h`` literals and
``reinterpret_cast`` of checked pointers are rewritten. Positions (lines and
columns) are kept so that compiler messages point into the kernel text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .common import COLLECTIVES, MSLTranslationError

FILE_SOURCE = 0
FILE_HEADER = 1
_FILE_NAMES = {FILE_SOURCE: "source", FILE_HEADER: "header"}


def _mask_comments_and_strings(text: str) -> str:
    """Same length as text; comments and literals blanked (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            for k in range(i, j):
                out[k] = " "
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            for k in range(i, j):
                if out[k] != "\n":
                    out[k] = " "
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            for k in range(i + 1, j - 1):
                out[k] = " "
            i = j
        else:
            i += 1
    return "".join(out)


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def _split_top_level(s: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch in "<[(":
            depth += 1
        elif ch in ">])":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


_COLLECTIVE_RE = re.compile(
    r"(?:(?:::)?\bmetal::)?\b("
    + "|".join(COLLECTIVES)
    + r")\b(?=\s*(?:<[^;(){}]*>)?\s*\()"
)
_THREADGROUP_RE = re.compile(r"\bthreadgroup\b")
_HALF_LITERAL_RE = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b"
)
_REINTERPRET_RE = re.compile(r"\breinterpret_cast\s*<")
_DECL_FIRST_RE = re.compile(
    r"^\s*(.*?\S)\s*\b([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)*)$", re.S
)
_DECL_MORE_RE = re.compile(r"^\s*([A-Za-z_]\w*)\s*((?:\[[^\[\]]+\]\s*)*)$", re.S)
_ALIGNAS_RE = re.compile(r"\balignas\s*\([^()]*\)")


@dataclass
class _Site:
    file: int
    line: int
    col: int
    op: str

    def describe(self) -> str:
        return f"{_FILE_NAMES[self.file]} line {self.line}, column {self.col}"


class _Translator:
    """Rewrites MSL kernel text into C++ for msl_shim.h (positions kept)."""

    def __init__(self, kernel_name: str):
        self.kernel_name = kernel_name
        self.sites: dict[int, _Site] = {}
        self.tg_count = 0

    def error(self, file: int, text: str, pos: int, what: str) -> MSLTranslationError:
        line, col = _line_col(text, pos)
        return MSLTranslationError(
            f"[msl harness] kernel '{self.kernel_name}': {what} "
            f"({_FILE_NAMES[file]} line {line}, column {col})"
        )

    def translate(self, text: str, file: int) -> str:
        masked = _mask_comments_and_strings(text)
        edits: list[tuple[int, int, str]] = []  # (start, end, replacement)

        for m in _COLLECTIVE_RE.finditer(masked):
            start = m.start()
            prev = masked[start - 1] if start > 0 else " "
            if prev == "." or masked[max(0, start - 2) : start] == "->":
                continue
            line, col = _line_col(text, m.start(1))
            if line >= (1 << 18) or col >= (1 << 10):
                site = 0
            else:
                site = (file << 28) | (line << 10) | col
                self.sites[site] = _Site(file, line, col, m.group(1))
            edits.append((start, m.end(), f"__msl_at<{site}u>::{m.group(1)}"))

        for m in _THREADGROUP_RE.finditer(masked):
            edit = self._threadgroup_decl(text, masked, m, file)
            if edit is not None:
                edits.append(edit)

        for m in _HALF_LITERAL_RE.finditer(masked):
            edits.append((m.start(), m.end(), f"(static_cast<half>({m.group(1)}))"))

        for m in _REINTERPRET_RE.finditer(masked):
            edits.append((m.start(), m.end(), "::msl::reinterpret_ptr<"))

        edits.sort()
        out, last = [], 0
        for start, end, rep in edits:
            if start < last:
                continue
            out.append(text[last:start])
            out.append(rep)
            last = end
        out.append(text[last:])
        return "".join(out)

    def _threadgroup_decl(self, text, masked, m, file):
        """`threadgroup T name[N];` -> storage shared by the threadgroup."""
        end = masked.find(";", m.end())
        if end < 0:
            return None
        seg = masked[m.end() : end]
        seg_plain = _ALIGNAS_RE.sub(" ", seg)
        flat = seg_plain
        while True:
            reduced = re.sub(r"\[[^\[\]]*\]", "", flat)
            if reduced == flat:
                break
            flat = reduced
        if any(ch in flat for ch in "*&(){}="):
            return None  # pointer, reference, parameter, cast or function
        parts = _split_top_level(seg_plain)
        first = _DECL_FIRST_RE.match(parts[0])
        if not first or not first.group(1).strip():
            raise self.error(
                file, text, m.start(), "unsupported threadgroup declaration"
            )
        type_name = " ".join(first.group(1).split())
        decls = [(first.group(2), first.group(3))]
        for extra in parts[1:]:
            d = _DECL_MORE_RE.match(extra)
            if not d:
                raise self.error(
                    file, text, m.start(), "unsupported threadgroup declaration"
                )
            decls.append((d.group(1), d.group(2)))
        code = []
        for name, dims in decls:
            self.tg_count += 1
            k = self.tg_count
            dims = "".join(dims.split())
            alias = f"__msl_tg_t{k}"
            code.append(
                f"using {alias} = {type_name}{dims}; auto& {name} = "
                f"*static_cast<{alias}*>(::msl::tg_alloc({k}, sizeof({alias}), "
                f"alignof({alias})));"
            )
        # keep the newlines of the declaration so that line numbers hold
        newlines = text[m.start() : end + 1].count("\n")
        return (m.start(), end + 1, " ".join(code) + "\n" * newlines)
