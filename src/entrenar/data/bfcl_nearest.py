"""Near-miss donors for `data sft-from-bfcl --swapped-nearest`: for a question, the other question whose functions
are closest in topic to it while still unable to answer it (a triangle-area question shown a body-mass-index
function, not a weather one, never a triangle-area one). BFCL's scored irrelevance category is made of such near
misses; random donors (another subject altogether) teach them poorly. docs/design.md ("BFCL") states the rule.

Closeness is a TF-IDF cosine over word sets: the question's side is its user text and its called functions' names
and descriptions; the donor's side is its functions' names, descriptions and parameter names. Words are lower-cased,
split at non-letters and camelCase, plural -s dropped; stop words, the generic name words of
bfcl_words._GENERIC_NAME_WORDS and words of two letters or fewer are left out. A word's weight is its smoothed
inverse document frequency over the distinct donor function sets (BFCL repeats one set over many questions).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import defaultdict
from collections.abc import Callable, Hashable
from typing import Any

from .bfcl_words import _GENERIC_NAME_WORDS, PYTHON_HINT, name_words

BfclQuestion = Any  # bfcl_data.BfclQuestion, not imported: bfcl_data calls this module

# Words that say nothing of a function's subject: English function words, request phrasing and the vocabulary
# every function doc shares (BFCL's Python hint among it).
_STOP_WORDS = frozenset({
    "a", "about", "above", "after", "again", "against", "also", "am", "an", "any", "are", "aren", "as", "at",
    "be", "because", "been", "before", "being", "below", "between", "both", "but", "can", "cannot", "could",
    "did", "does", "doing", "don", "down", "during", "each", "either", "else", "etc", "even", "ever", "every",
    "few", "from", "further", "had", "has", "have", "having", "her", "here", "hers", "him", "his", "how",
    "however", "into", "its", "itself", "just", "let", "like", "may", "might", "mine", "more", "most", "much",
    "must", "myself", "no", "nor", "not", "now", "off", "once", "one", "only", "other", "our", "ours", "out",
    "over", "own", "per", "please", "same", "she", "should", "since", "some", "such", "than", "that", "the",
    "their", "theirs", "them", "then", "there", "these", "they", "this", "those", "through", "too", "under",
    "until", "upon", "very", "via", "was", "way", "well", "were", "what", "when", "where", "whether", "which",
    "while", "who", "whom", "whose", "why", "will", "with", "within", "without", "would", "yes", "yet", "you",
    "your", "yours", "want", "need", "help", "tell", "show", "give", "know", "provide", "provided", "find",
    "using", "use", "used", "make", "sure", "thank", "thanks", "hey", "hello", "function", "functions",
    "parameter", "parameters", "argument", "arguments", "note", "syntax", "python", "value", "values", "return",
    "returns", "returned", "default", "optional", "required", "type", "string", "integer", "number", "boolean",
    "array", "dict", "object", "specified", "specific", "given", "based", "format", "example",
    "instance", "current", "currently", "true", "false", "null", "none", "name", "names", "description"})
_MIN_LEN = 3
# A description word of a question's called function is one of its specific subject words, which no donor may
# share (the can't-answer rule), when at most this fraction of the distinct function sets holds it: "weather" (15%
# of live_*'s sets) and "food" (3%) are, "city" (25%), "location" (34%) and "date" (35%) are not.
_SPECIFIC_MAX_DF = 0.2
# Words a plural -s does not end: "news" is not "new".
_NOT_PLURAL = frozenset({"news", "series", "species", "physics", "mathematics", "economics", "statistics"})
# A donor's function set is shown at most this many times, so the rows are varied.
MAX_USES = 2


def _stem(word: str) -> str:
    """Plural to singular, crudely: enough that "triangles" meets "triangle" (categories -> category, searches ->
    search, movies -> movie)."""
    if word in _NOT_PLURAL:
        return word
    if word.endswith(("vies", "kies")):
        return word[:-1]
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "sses", "xes", "zes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


@functools.cache
def topic_words(text: str) -> frozenset[str]:
    """The subject words of a text: camelCase split, lower-cased, runs of letters, plural -s dropped, stop words,
    generic name words and words of two letters or fewer left out."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text.replace(PYTHON_HINT, ""))
    out = set()
    for w in re.findall(r"[a-z]+", text.lower()):
        if len(w) >= _MIN_LEN and w not in _STOP_WORDS and w not in _GENERIC_NAME_WORDS:
            s = _stem(w)
            if s not in _STOP_WORDS and s not in _GENERIC_NAME_WORDS:
                out.add(s)
    return frozenset(out)


def _user_text(question: BfclQuestion) -> str:
    return " ".join(str(m.get("content") or "") for m in question.messages if m.get("role") == "user")


def _function_text(f: dict[str, Any], params: bool) -> str:
    text = f"{f['name']} {f.get('description', '')}"
    if params:
        text += " " + " ".join((f.get("parameters") or {}).get("properties", {}))
    return text


def called_functions(question: BfclQuestion) -> list[dict[str, Any]]:
    """The functions the question's answer calls (all its functions when it has no answer)."""
    if not question.answer:
        return question.functions
    called = {name for entry in question.answer for name in entry}
    return [f for f in question.functions if f["name"] in called] or question.functions


def function_set_key(functions: list[dict[str, Any]]) -> str:
    """A donor's identity for the use cap and its words: its function docs, whole (BFCL shows one set to many
    questions, and one name, requests.get, with many descriptions)."""
    return json.dumps(sorted(functions, key=lambda f: f["name"]), sort_keys=True)


class TopicIndex:
    """Every question's topic vector and every distinct donor function set's, for the cosine between a
    question and a donor, and the can't-answer rule (cannot_answer)."""

    def __init__(self, questions: list[BfclQuestion]) -> None:
        self.questions = questions
        self.keys = [function_set_key(q.functions) for q in questions]
        sets: dict[str, set[str]] = {}
        self.donor_name_words: dict[str, set[str]] = {}
        for q, key in zip(questions, self.keys):
            if key not in sets:
                self.donor_name_words[key] = set().union(*(topic_words(f["name"]) for f in q.functions))
                sets[key] = set().union(*(topic_words(_function_text(f, True)) for f in q.functions))
        df: dict[str, int] = defaultdict(int)
        for words in sets.values():
            for w in words:
                df[w] += 1
        n = len(sets)
        self.idf = {w: math.log((1 + n) / (1 + d)) + 1 for w, d in df.items()}
        self._unseen_idf = math.log(1 + n) + 1
        self.donor_words = sets
        self.donor_norm = {k: math.sqrt(sum(self.idf[w] ** 2 for w in ws)) for k, ws in sets.items()}
        postings: dict[str, list[tuple[str, float]]] = defaultdict(list)
        for k, ws in sets.items():
            for w in ws:
                postings[w].append((k, self.idf[w]))
        self.postings = postings
        self.n_sets = n
        self.df = df
        self.name_words = [name_words(q.functions) for q in questions]
        self.own_names = [{f["name"].lower() for f in q.functions} for q in questions]
        self.user_words = [topic_words(_user_text(q)) for q in questions]
        self.specific = [self._specific_words(q) for q in questions]

    def weight(self, word: str) -> float:
        return self.idf.get(word, self._unseen_idf)

    def question_words(self, i: int) -> set[str]:
        """Question i's topic: its user text and its called functions' names and descriptions."""
        q = self.questions[i]
        return topic_words(_user_text(q)).union(*(topic_words(_function_text(f, False)) for f in called_functions(q)))

    def _specific_words(self, q: BfclQuestion) -> set[str]:
        """The question's own subject: the words of all its functions' names, and its called functions'
        description words held by at most _SPECIFIC_MAX_DF of the function sets (or by its own set alone)."""
        words = set().union(*(topic_words(f["name"]) for f in q.functions))
        for f in called_functions(q):
            words.update(w for w in topic_words(f.get("description", ""))
                         if self.df.get(w, 0) <= max(1.0, _SPECIFIC_MAX_DF * self.n_sets))
        return words

    def similarities(self, i: int) -> dict[str, float]:
        """The cosine of question i with every donor function set sharing a word with it (others: 0)."""
        words = self.question_words(i)
        norm = math.sqrt(sum(self.weight(w) ** 2 for w in words))
        dots: dict[str, float] = defaultdict(float)
        for w in words:
            for k, weight in self.postings.get(w, ()):
                dots[k] += weight * weight
        return {k: d / (norm * self.donor_norm[k]) for k, d in dots.items() if norm and self.donor_norm[k]}

    def similarity(self, i: int, j: int) -> float:
        return self.similarities(i).get(self.keys[j], 0.0)

    def cannot_answer(self, i: int, j: int) -> bool:
        """Whether donor j's functions cannot answer question i: j has functions, none named as one of i's own,
        no subject word of their names among i's (bfcl_words.name_words) nor in i's user text ("lowest temperature
        reading" is never shown get_temperature), and their names, descriptions and parameter names hold none of
        i's own functions' most specific words (_specific_words: set_volume's question is never shown
        play_spotify_song(query, volume))."""
        donor = self.questions[j]
        if j == i or not donor.functions or self.name_words[i] & self.name_words[j]:
            return False
        if self.user_words[i] & self.donor_name_words[self.keys[j]]:
            return False
        if any(f["name"].lower() in self.own_names[i] for f in donor.functions):
            return False
        return not self.specific[i] & self.donor_words[self.keys[j]]


def nearest_donors(questions: list[BfclQuestion], order: list[int], n: int,
                   group: Callable[[int], Hashable] | None = None,
                   max_uses: int = MAX_USES) -> list[tuple[int, int, float]]:
    """(question, donor, cosine) for up to n questions taken in `order`: each question's donor is the most
    similar one (TopicIndex.similarities) that cannot answer it (TopicIndex.cannot_answer) and whose function set
    was shown fewer than max_uses times; ties (and donors sharing no word) in `order`. group(i): donors only of
    question i's group (--swapped-matched: category and tool count). A question without such a donor is passed
    over. Donors showing one function set are one candidate: the first of them in `order`."""
    index = TopicIndex(questions)
    group = group or (lambda i: None)
    # per group, each function set's questions in the seed's order (the first but the question itself is shown)
    members: dict[Hashable, dict[str, list[int]]] = defaultdict(dict)
    for j in order:
        members[group(j)].setdefault(index.keys[j], []).append(j)
    uses: dict[str, int] = defaultdict(int)
    out: list[tuple[int, int, float]] = []
    for i in order:
        if len(out) >= n:
            break
        sims = index.similarities(i)
        firsts = [(js[0] if js[0] != i else (js[1] if len(js) > 1 else None), k)
                  for k, js in members[group(i)].items() if uses[k] < max_uses]
        # the most similar first, ties in the seed's order (set order is the order of first appearance)
        for j, k in sorted(((j, k) for j, k in firsts if j is not None), key=lambda jk: -sims.get(jk[1], 0.0)):
            if index.cannot_answer(i, j):
                uses[k] += 1
                out.append((i, j, sims.get(k, 0.0)))
                break
    return out


def mean_similarity(questions: list[BfclQuestion], rows: list[dict[str, Any]]) -> float:
    """The mean cosine of swapped rows' questions with their donors' functions (ids QUESTION+tools-of-DONOR)."""
    index = TopicIndex(questions)
    at = {q.task_id: i for i, q in enumerate(questions)}
    sims = []
    for row in rows:
        own, donor = row["id"].split("+tools-of-")
        sims.append(index.similarities(at[own]).get(index.keys[at[donor]], 0.0))
    return round(sum(sims) / len(sims), 4) if sims else 0.0
