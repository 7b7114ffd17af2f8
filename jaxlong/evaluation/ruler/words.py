"""Keys, values and words of RULER's synthetic tasks (Hsieh et al., arXiv 2404.06654, §3), drawn by seed and
checked against the run's tokenizer.

Every string a task puts in its input goes through `Pieces`: literal template text is encoded whole, and every
slot (a key, a value, a word) is encoded on its own with one leading space, `encode(" " + slot)`. The answer's
tokens are the same slot encodings, so the answer appears in the input token for token wherever the task put
it, whatever the tokenizer's merges (byte-level or a Hugging Face `tokenizer.json`).

A slot must *spell* its text: `decode(encode(" " + text)) == " " + text` (no unknown tokens, nothing dropped),
else two different values could encode alike. `Lexicon` keeps only the words the tokenizer spells, and refuses
numbers or UUIDs (ValueError naming the task option) when the tokenizer cannot spell digits.
"""

from __future__ import annotations

import re
from typing import Iterable

import numpy as np

# Common English nouns and adjectives (keys are "adjective-noun" pairs, as RULER's wonderwords keys; the
# common-words task draws its words from both lists). None of them is a word of the filler text.
NOUNS = """
apple anchor angle ankle arrow attic badge bakery ballad bamboo banjo barrel basket beacon bicycle blanket
bottle bracelet bridge bucket button cabin cactus camera candle canoe canyon carpet castle cattle cellar
chapel cherry chimney circus cliff clock cloud coffee comet copper cottage cradle crayon crystal curtain
cushion daisy desert diamond dolphin donkey dragon drum eagle engine falcon feather fiddle forest fountain
garden garlic giraffe glacier goblet hammer harbor harvest helmet hermit honey horizon island jacket jungle
kettle kitten ladder lantern lemon library lizard lobster magnet mango marble meadow mirror monkey mountain
napkin needle oasis ocean orchard otter owl paddle palace parrot peanut pebble pencil pepper piano pillow
pirate planet pocket pony puzzle rabbit radish raven ribbon river rocket saddle salmon sandal scarf shadow
shovel silver spider sponge squirrel statue stove sugar tablet teapot temple tiger tomato tractor trumpet
tunnel turtle umbrella valley velvet violin wagon walnut whistle willow window wizard zebra
""".split()
ADJECTIVES = """
ancient bitter bold brave breezy bright brisk calm clever cozy crisp curious daring dusty eager early
elegant fancy fierce fluffy fragile gentle giant glossy golden graceful grumpy handsome happy hollow humble
icy jolly keen lively lonely loud lucky marvelous mellow merry mighty misty modest muddy narrow noble odd
plain polite proud quaint quick quiet rapid rare rough royal rustic sandy shiny silent silly sleepy slim
smooth snowy sour spicy steady stormy sturdy sunny swift tame tender thirsty tidy tiny tough vast vivid
wandering warm wild windy wise witty wooden young zesty
""".split()

_SLOT = re.compile(r" \{(\w+)\}")


class Pieces:
    """A tokenizer's `encode` with the slot convention above (and a cache: the same slot text is encoded once).

    `pieces(text)`: int32 `[n]`, the text encoded whole. `pieces.slot(text)`: `encode(" " + text)`.
    `pieces.fill(template, **slots)`: the template's literal parts encoded whole and each `" {name}"` as
    `slot(slots[name])`, concatenated."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, np.ndarray] = {}
        self._ends: dict[int, bool] = {}

    def __call__(self, text: str) -> np.ndarray:
        out = self._cache.get(text)
        if out is None:
            out = self._cache[text] = np.asarray(self.tokenizer.encode(text), np.int32)
        return out

    def slot(self, text: str) -> np.ndarray:
        return self(" " + text)

    def fill(self, template: str, **slots: str) -> np.ndarray:
        parts, at = [], 0
        for m in _SLOT.finditer(template):
            if m.start() > at:
                parts.append(self(template[at:m.start()]))
            parts.append(self.slot(slots[m.group(1)]))
            at = m.end()
        if at < len(template):
            parts.append(self(template[at:]))
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def ends_sentence(self, token: int) -> bool:
        """Whether the token's text ends with "." (a needle may follow it)."""
        out = self._ends.get(token)
        if out is None:
            out = self._ends[token] = self.tokenizer.decode([token]).rstrip().endswith(".")
        return out

    def spells(self, text: str) -> bool:
        """Whether `" " + text` survives encode and decode unchanged."""
        return self.tokenizer.decode(self.slot(text)) == " " + text

    def join(self, items: Iterable[str]) -> np.ndarray:
        """The answer format: `slot(a) + encode(",") + slot(b) + ...` (a list of values, in the stated order)."""
        out = []
        for i, item in enumerate(items):
            if i:
                out.append(self(","))
            out.append(self.slot(item))
        return np.concatenate(out) if out else np.zeros(0, np.int32)


class Lexicon:
    """Random keys, values and words for one tokenizer.

    Kinds: `"numbers"` (RULER: 7-digit numbers for needles, 5-digit for variable tracking; no leading zero),
    `"words"` (adjective-noun pairs such as `"misty-falcon"`, RULER's key form), `"uuids"` (RULER's uuid4 form,
    drawn from the seed). Raises ValueError when the tokenizer cannot spell the kind (e.g. a vocabulary without
    digits asked for numbers), naming `option`."""

    def __init__(self, pieces: Pieces):
        self.pieces = pieces
        self.nouns = [w for w in NOUNS if pieces.spells(w)]
        self.adjectives = [w for w in ADJECTIVES if pieces.spells(w)]
        self.letters = "".join(c for c in "abcdefghijklmnopqrstuvwxyz" if pieces.spells(c * 3))
        self.upper = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if pieces.spells(c * 3))
        self._digits = pieces.spells("1234567890") and pieces.spells("abcdef-0123456789")
        if len(self.nouns) < 20 or len(self.adjectives) < 20 or len(self.letters) < 6:
            raise ValueError(f"tokenizer {pieces.tokenizer.name!r} spells too few English words for the RULER tasks "
                             f"({len(self.nouns)} nouns, {len(self.adjectives)} adjectives)")

    def check(self, kind: str, option: str) -> None:
        """Raise ValueError unless `kind` is one of the kinds above and the tokenizer spells it."""
        if kind not in ("numbers", "words", "uuids"):
            raise ValueError(f"{option}={kind!r}: give 'numbers', 'words' or 'uuids'")
        if kind in ("numbers", "uuids") and not self._digits:
            raise ValueError(f"{option}={kind!r}: tokenizer {self.pieces.tokenizer.name!r} cannot spell digits "
                             f"(they decode differently); use {option}='words'")

    def draw(self, rng: np.random.Generator, kind: str, n: int, *, digits: int = 7,
             exclude: Iterable[str] = ()) -> list[str]:
        """`n` distinct strings of `kind`, none in `exclude`."""
        out: list[str] = []
        seen = set(exclude)
        while len(out) < n:
            if kind == "numbers":
                s = str(rng.integers(10 ** (digits - 1), 10**digits))
            elif kind == "words":
                s = f"{self.adjectives[rng.integers(len(self.adjectives))]}-{self.nouns[rng.integers(len(self.nouns))]}"
            else:
                h = "".join("0123456789abcdef"[i] for i in rng.integers(0, 16, 32))
                s = f"{h[:8]}-{h[8:12]}-4{h[13:16]}-{'89ab'[int(h[16], 16) % 4]}{h[17:20]}-{h[20:]}"
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out

    def variables(self, rng: np.random.Generator, n: int) -> list[str]:
        """`n` distinct variable names of 5 upper-case letters (RULER's variable tracking)."""
        letters = self.upper if len(self.upper) >= 4 else self.letters.upper()
        seen, out = set(), []
        while len(out) < n:
            s = "".join(letters[i] for i in rng.integers(0, len(letters), 5))
            if s not in seen and self.pieces.spells(s):
                seen.add(s)
                out.append(s)
        return out

    def coded_words(self, rng: np.random.Generator, n: int, exclude: Iterable[str] = ()) -> list[str]:
        """`n` distinct random lower-case "coded words" of 3 to 6 letters (RULER's frequent-words task; also the
        rare words of common-words extraction once the English words run out)."""
        seen, out = set(exclude) | set(NOUNS) | set(ADJECTIVES), []
        while len(out) < n:
            k = int(rng.integers(3, 7))
            s = "".join(self.letters[i] for i in rng.integers(0, len(self.letters), k))
            if s not in seen:
                seen.add(s)
                out.append(s)
        return out
