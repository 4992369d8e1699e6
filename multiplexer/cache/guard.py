"""Whether two questions that embed close together ask the same thing.

Cosine similarity cannot tell "a flight from Paris to Rome" from "from Rome to Paris", or
baking soda from baking powder: they score 0.95 and more. The guard is the cache's feature:
a neighbour the index found is a hit only when the two texts agree on

- their **numbers** (digits, decimals, number words, versions such as ``3.12``),
- their **units** (``km`` and ``kilometres`` are one unit; ``km`` and ``miles`` are not),
- their **negations** (``not``, ``n't``, ``never``, ``without``, ... counted),
- the **roles and order of their entities** (``from X to Y``, ``X than Y``, and the order of
  the capitalised names both mention),
- their **content words**: the words left after stop words (filler and the vocabulary of asking:
  "give me", "what is the meaning of", "the syntax for", "the best way to"), light stemming
  (a verb and its noun agree: explain and explanation, summarize and summary, differ and
  difference) and a table of synonyms; a word one text has in place of another's is a refusal
  (soda and powder, approve and deny, hidden files and files). One text may add a few frame
  nouns the other lacks ("which **city** is the capital", "error **code** E42", "the **word**
  cactus"), only where the other adds nothing of its own ("largest city" vs "largest country"
  is a substitution and refused). A verb and its particle are first read as the one verb they
  mean ("turn off" as "disable"); a time unit one side names without numbers ("in what year"
  for "when") and a last "cause" after effects or symptoms are no difference.

Frames that say one thing in other words are rewritten before the words are read, each a class:
a dimension asked with "how" and its adjective is the dimension's noun ("how fast does light
travel" / "the speed of light", "how many people live in" / "the population of"; "how cold" keeps
its "cold"); ordinals, Roman numerals after a name and ordinal digits are numbers (World War II,
the Second World War, WW2 and the 2nd World War agree; World War I does not); "what makes X" and
"what causes X" ask why; "another word for" asks a synonym; "how do you say X in L" and "the L
word for X" ask to translate; "what command lists" and "the function to sort" ask how; a first
clause of state ("I forgot my password, how can I reset it?") drops its verb when the question
points back at it, and two such clauses must agree ("I lost a wallet" / "I found a wallet").

It is deliberately strict: a paraphrase that swaps vocabulary outside the synonym table is a
miss (one more upstream call), never a wrong answer. Pure functions; no model, nothing loaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

_TOKEN = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?|\d+(?:[.,]\d+)*(?:\.\d+)?|[%$€£°+#]")
_VERSION = re.compile(r"\b[vV]?\d+(?:\.\d+)+\b")
# a verb and its particle that say what one verb says ("turn off" / "disable"), rewritten first
_PHRASAL = tuple((re.compile(pattern, re.IGNORECASE), verb) for pattern, verb in (
    (r"\b(?:turn|switch|shut)(?:s|ed|ing)?\s+(?:(?:it|them)\s+)?off\b", "disable"),
    (r"\b(?:turn|switch)(?:s|ed|ing)?\s+(?:(?:it|them)\s+)?on\b", "enable"),
    (r"\bget(?:s|ting)?\s+rid\s+of\b", "remove"),
    (r"\b(?:sign|log)(?:s|ged|ging|ed|ing)?\s+(?:in|into)\b", "login"),
    (r"\b(?:sign|log)(?:s|ged|ging|ed|ing)?\s+out\b", "logout"),
    (r"\bsign(?:s|ed|ing)?\s+up\b", "register"),
    (r"\bspeed(?:s|ing)?\s+up\b", "accelerate"),
))
_PHRASAL_VERB = re.compile(r"\b(?:turn|switch|shut|get|sign|log|speed)", re.IGNORECASE)

# a dimension asked with "how" and an adjective asks for the dimension's noun: "how fast does
# light travel" / "the speed of light"; the adjectives that name the low end keep their word
# ("how cold" is the temperature and cold: not "how hot")
_DIMENSIONS = {
    "fast": "speed", "quick": "speed", "quickly": "speed", "rapidly": "speed",
    "slow": "speed slow", "slowly": "speed slow", "tall": "height", "high": "height",
    "short": "height short", "long": "length", "big": "size", "large": "size", "huge": "size",
    "small": "size small", "heavy": "weight", "old": "age", "young": "age young",
    "far": "distance", "close": "distance close", "near": "distance close", "hot": "temperature",
    "warm": "temperature", "cold": "temperature cold", "wide": "width", "deep": "depth",
    "expensive": "price", "costly": "price", "cheap": "price cheap",
}
_HOW_DIMENSION = re.compile(
    r"\bhow\s+(?:(many|much)\s+(?:people|persons|inhabitants|residents)"
    r"(?:\s+(?:live|lives|living|reside|are\s+there|are|is\s+there))?|(" + "|".join(_DIMENSIONS) + r"))\b",
    re.IGNORECASE)
# frames that say one thing in other words, rewritten before the words are read; each names a
# class, not a question: "what makes X" / "what causes X" / "why X"; "another word for" /
# "a synonym for"; "how do you say X in L" / "translate X into L"; "what command lists" /
# "how do I list"; "boiling point" / "the temperature it boils at"; "WW2" / "World War II";
# "stand for" / "short for" / "an acronym for"; "last longer" / "extend its life"
_ASKING = ("command", "shortcut", "function", "method")
_CAUSING = ("made", "make", "caus")
_FRAMES = tuple((frozenset(keys), re.compile(pattern, re.IGNORECASE), repl) for keys, pattern, repl in (
    # (words one of which the frame needs, looked for in the lowered text first; its pattern;
    # what it reads as)
    (("ww",), r"\bWW\s?(?:II|2)\b", "World War II"),
    (("ww",), r"\bWW\s?(?:I|1)\b", "World War I"),
    (("come",), r"\bhow\s+come\b", "why"),
    (_CAUSING, r"\bwhat\s+(?:makes|made|causes|caused)\s+(.{1,60}?)\s+"
     r"(?:look|looks|appear|appears|seem|seems)\s+(?!like\b)", r"why \1 "),
    (("reason",), r"\bwhat\s+(?:is|are|was|were)\s+the\s+reasons?\s+(?:why|that)\b", "why"),
    (_CAUSING, r"\bwhat\s+(?:makes|made|causes|caused)\b", "why"),
    (("other", "another"), r"\b(?:an)?other\s+(?:word|term)s?\b", "synonym"),
    (("mean",), r"\b(?:a\s+)?(?:word|term)s?\s+(?:that\s+means?|meaning)\b", "synonym for"),
    (("word", "term"), r"\b(?:what\s+is|what's|whats)\s+the\s+((?-i:[A-Z])[a-z]+)\s+(?:word|term)\s+for\s+"
     r"([^?.!]{1,40})", r"translate \2 in \1"),
    (("say",), r"\bhow\s+(?:do|would|can|could|should|does)\s+(?:you|i|we|one|someone)\s+say\b", "translate"),
    (_ASKING, r"\b(?:what|which)\s+((?:[a-z]+\s+)?)(?:command|shortcut|function|method)s?\s+"
     r"(?:(?:do|can|should|would)\s+i\s+use\s+to\s+|is\s+used\s+to\s+|to\s+use\s+to\s+|to\s+|that\s+)?",
     r"\1 how do I "),
    (_ASKING, r"\b(?:the|a)\s+(?:command|shortcut|function|method)\s+(?:to|for|that)\b", "how to"),
    (("point",), r"\b(boil|boiling|freez|freezing|melt|melting|dew|flash|smoke|smoking)\s+points?\b",
     r"\1 temperature"),
    (("for",), r"\b(?:stands?|short|an?\s+abbreviation|an?\s+acronym)\s+for\b", "acronym for"),
    (("full",), r"\b(?:the\s+)?full\s+form\s+of\b", "the acronym for"),
    (("recipe",), r"\b(?:a\s+|the\s+)?recipe\s+(?:for|to\s+make)\b", "how to make"),
    (("vs", "versus"), r"\b(?:vs\.?|versus)(?=\s)", "and differ"),
    (("life",), r"\blife\s+(?:expectancy|span)\b", "lifespan"),
    (("live",), r"\bhow\s+long\s+(?:do|does|can|will|did|should)\s+(.{1,40}?)\s+live\b", r"how lifespan \1"),
    (("faster",), r"\bmake\s+(.{1,30}?)\s+(?:run\s+|go\s+|work\s+|load\s+)?faster\b", r"accelerate \1"),
    (("fastest", "quickest"), r"\b(?:the\s+)?(?:fastest|quickest)\s+way\b", "fast"),
    (("from",), r"\b(?:stop|keep)\s+(.{1,30}?)\s+from\b", r"prevent \1 from"),
    (("stop",), r"\bstop\s+((?:my|your|the|a|an|his|her|their|our)\s+[a-z]+)\s+(?=[a-z]+ing\b)",
     r"prevent \1 from "),
    (("tell",), r"\btell\s+(?:if|whether)\b", "know if"),
    (("from",), r"\bcomes?\s+from\b", "originate"),
    (("on",), r"\bon\s+(?:the\s+)?(?:planet\s+)?earth\b|\bon\s+the\s+planet\b", "in the world"),
    (("colo",), r"\bin\s+colou?r\b", ""),
    (("average",), r"\bon\s+average\b", "average"),
    (("out",), r"\bget\s+(.{1,30}?)\s+out\s+of\b", r"remove \1 from"),
    (("terms",), r"\bin\s+(?:simple|plain|layman'?s?|easy)\s+terms\b", ""),
    (("longer",), r"\bmake\s+(.{1,40}?)\s+last\s+longer\b", r"extend \1 life"),
    (("longer",), r"\blast\s+longer\b", "extend life"),
    (("longer",), r"\bmake\s+(.{1,30}?)\s+longer\b", r"extend \1"),
    (("better",), r"\bmake\s+(.{1,30}?)\s+better\b", r"improve \1"),
))
# one search finds which frames' words a text has (each a word's start: none hides another)
_FRAME_KEYS = re.compile(r"\b(?:" + "|".join(sorted({re.escape(k) for keys, _, _ in _FRAMES for k in keys},
                                                      key=len, reverse=True)) + ")")
# a first clause that gives the asker's state before the question ("I forgot my password, how
# can I reset it?"): its verb of state is no content; the verb of any such clause is kept apart
# so that two clauses compare ("I lost a wallet" / "I found a wallet")
_CONTEXT = re.compile(
    r"^\W*(?:(?:so|well|hi|hey|ok|okay|um|help)\W+)?I(?:'ve|\s+have|'m|\s+am|'d|\s+had)?\s+"
    r"(?:(?:just|accidentally|recently|really|already|completely|totally|somehow)\s+)*"
    r"(can'?t\s+remember|cannot\s+remember|don'?t\s+remember|do\s+not\s+remember|[a-z]+)\b",
    re.IGNORECASE)
_STATE_VERBS = {"forgot": "forget", "forget": "forget", "forgotten": "forget",
                "lost": "lose", "misplaced": "lose", "need": "want", "needed": "want",
                "want": "want", "wanted": "want", "trying": "want", "tried": "want", "try": "want",
                "would": "want", "wish": "want", "hope": "want", "plan": "want", "planning": "want"}

NUMBER_WORDS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "hundred": 100, "thousand": 1000,
    "million": 1_000_000, "billion": 1_000_000_000, "dozen": 12, "half": 0.5, "twice": 2,
    "double": 2, "triple": 3, "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5,
    "sixth": 6, "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10, "eleventh": 11,
    "twelfth": 12, "twentieth": 20, "hundredth": 100, "earliest": 1,
}
_ORDINAL_DIGITS = re.compile(r"\b(\d+)(?:st|nd|rd|th)\b", re.IGNORECASE)
_NUMBER_SIGN = re.compile(r"\b[Nn]o\.\s*(?=\d)")
_ROMAN = re.compile(r"X{0,3}(?:IX|IV|V?I{0,3})")
_ROMAN_VALUES = {"I": 1, "V": 5, "X": 10}

# spellings of one unit -> its one name
UNITS = {
    "km": "km", "kilometer": "km", "kilometre": "km", "kms": "km",
    "mile": "mile", "mi": "mile", "m": "meter", "meter": "meter", "metre": "meter",
    "cm": "cm", "centimeter": "cm", "centimetre": "cm", "mm": "mm", "millimeter": "mm",
    "millimetre": "mm", "ft": "foot", "foot": "foot", "feet": "foot", "inch": "inch", "in.": "inch",
    "yard": "yard", "kg": "kg", "kilogram": "kg", "kilo": "kg", "g": "gram", "gram": "gram",
    "mg": "mg", "milligram": "mg", "lb": "pound", "lbs": "pound", "pound": "pound",
    "oz": "ounce", "ounce": "ounce", "ton": "ton", "tonne": "tonne",
    "l": "liter", "liter": "liter", "litre": "liter", "ml": "ml", "milliliter": "ml",
    "millilitre": "ml", "gallon": "gallon", "gal": "gallon", "cup": "cup", "tablespoon": "tbsp",
    "tbsp": "tbsp", "teaspoon": "tsp", "tsp": "tsp", "pint": "pint", "quart": "quart",
    "celsius": "celsius", "centigrade": "celsius", "°c": "celsius", "fahrenheit": "fahrenheit",
    "°f": "fahrenheit", "kelvin": "kelvin",
    "second": "second", "sec": "second", "secs": "second", "minute": "minute", "min": "minute",
    "mins": "minute", "hour": "hour", "hr": "hour", "hrs": "hour", "day": "day", "week": "week",
    "month": "month", "year": "year", "yr": "year", "ms": "ms", "millisecond": "ms",
    "kb": "kb", "kilobyte": "kb", "mb": "mb", "megabyte": "mb", "gb": "gb", "gigabyte": "gb",
    "tb": "tb", "terabyte": "tb", "byte": "byte", "bit": "bit", "mbps": "mbps",
    "dollar": "usd", "usd": "usd", "$": "usd", "euro": "eur", "eur": "eur", "€": "eur",
    "pound sterling": "gbp", "gbp": "gbp", "£": "gbp", "yen": "jpy", "jpy": "jpy",
    "percent": "%", "%": "%", "mph": "mph", "kph": "kph", "kmh": "kph", "watt": "watt",
    "kw": "kw", "kilowatt": "kw", "kwh": "kwh", "volt": "volt", "amp": "amp", "hz": "hz",
    "ghz": "ghz", "mhz": "mhz", "calorie": "calorie", "kcal": "calorie", "acre": "acre",
    "hectare": "hectare",
}

NEGATIONS = {"not", "no", "never", "without", "none", "nobody", "nothing", "neither", "nor",
             "cannot", "can't", "won't", "don't", "doesn't", "didn't", "isn't", "aren't", "wasn't",
             "weren't", "shouldn't", "wouldn't", "couldn't", "haven't", "hasn't", "hadn't",
             "mustn't", "needn't", "nowhere", "unable", "fail", "fails", "failed", "failing"}

# roles a preposition gives the word right after it; the word right before ``to`` takes the
# other side of the relation
_AFTER = {"for": "for", "from": "src", "to": "dst", "into": "dst", "towards": "dst", "toward": "dst",
          "than": "cmp_b", "per": "per", "over": "over", "under": "under", "before": "before",
          "after": "after"}
# words after which a short unit name (km, mb, l) is a unit, not a word
_UNIT_BEFORE = {"to", "in", "into", "from", "per", "of"}
# words that sit between a preposition and the word it governs
_SKIP = {"the", "a", "an", "my", "your", "our", "their", "his", "her", "its", "this", "that"}

STOPWORDS = frozenset(str.split("""
a an the and or but if then so of at by for with about as on in into onto from to up down out
off over under again further once here there when where how what which who whom whose this
that these those am is are was were be been being have has had having do does did doing would
should could can will may might must shall i me my myself we our ours ourselves you your yours
yourself yourselves he him his himself she her hers herself it its itself they them their theirs
themselves s t just also too very really actually exactly basically simply please kindly quick
briefly tell explain know want need like help question way thing things someone anyone
somebody anybody possible hi hello hey thanks thank guys any some get got give show let me us
does doing done go going i'm i've i'd i'll it's what's how's that's there's where's who's
you're we're they're is there anything something best good correct right proper properly
mean means meaning definition describe description step steps example examples give way ways
find out figure learn understand sure okay ok well still ever even much many more most
use using used check located locate acronym tip tips recipe people
between see view say suggest recommend recommendation command syntax formula equation method
procedure purpose principle instruction instructions guide approach technique tutorial advice
manner able option main mainly common commonly typical typically usual usually normally
generally particular certain specific calculate compute determine define take easiest simplest
whether average away
""")) - NEGATIONS

# words one question may add to the other's and still ask the same thing ("which city is the
# capital of Spain", "the word cactus", "error code E42"), as long as the other adds nothing
# of its own: "largest city" vs "largest country" replaces one with another and is refused
FRAME_NOUNS = frozenset(str.split("""
city town country nation place person scientist language program software app tool company
name number amount quantity file document item element novel book film movie song album
quality world model
"""))
# frame nouns that may also stand in for each other ("exit code 137" / "exit status 137")
FRAME_FILLERS = frozenset(str.split("code status word term form kind type"))
# units of time one question may name and the other not, when neither has a number ("when was
# it built" / "in what year was it built"); with numbers, units always agree
_TIME_UNITS = frozenset(("year", "month", "week", "day", "hour", "minute", "second"))
# "what symptoms does X cause": a last ``cause`` after one of these nouns names no reason
_EFFECTS = frozenset(str.split("effect symptom consequence result problem damage complication risk"))

# irregular forms and agent nouns -> the verb they come from
IRREGULAR = {
    "wrote": "write", "written": "write", "author": "write", "writer": "write",
    "painter": "paint", "inventor": "invent", "composer": "compose", "director": "direct",
    "founder": "found", "designer": "design", "developer": "develop", "producer": "produce",
    "owner": "own", "singer": "sing", "leader": "lead", "discoverer": "discover", "creator": "create",
    "spoken": "speak", "spoke": "speak", "froze": "freeze", "frozen": "freeze", "made": "make",
    "built": "build", "ran": "run", "began": "begin", "begun": "begin", "took": "take",
    "taken": "take", "gave": "give", "given": "give", "ate": "eat", "eaten": "eat",
    "drove": "drive", "driven": "drive", "flew": "fly", "flown": "fly", "grew": "grow",
    "grown": "grow", "knew": "know", "known": "know", "saw": "see", "seen": "see",
    "went": "go", "gone": "go", "did": "do", "found": "find", "bought": "buy", "sold": "sell",
    "thought": "think", "taught": "teach", "caught": "catch", "brought": "bring", "lost": "lose",
    "won": "win", "children": "child", "men": "man", "women": "woman", "mice": "mouse",
    "feet": "foot", "teeth": "tooth", "geese": "goose", "people": "person",
    # a noun made of a verb (or back) asks the same: "give me an explanation of" / "explain"
    "explanation": "explain", "definition": "define", "description": "describe",
    "summarize": "summary", "summarise": "summary", "summarization": "summary",
    "meaning": "mean", "difference": "differ", "different": "differ", "differently": "differ",
    "installation": "install", "translation": "translate", "calculation": "calculate",
    "comparison": "compare", "conversion": "convert", "deletion": "delete", "removal": "remove",
    "creation": "create", "prevention": "prevent", "reduction": "reduce", "invention": "invent",
    "discovery": "discover", "decision": "decide", "solution": "solve", "addition": "add",
    "subtraction": "subtract", "multiplication": "multiply", "division": "divide",
    "generation": "generate", "production": "produce", "connection": "connect",
    "configuration": "configure", "config": "configure", "registration": "register",
    "cancellation": "cancel", "subscription": "subscribe", "payment": "pay",
    "replacement": "replace", "improvement": "improve", "treatment": "treat",
    "requirement": "require", "development": "develop", "growth": "grow", "loss": "lose",
    "choice": "choose", "proof": "prove", "belief": "believe", "response": "respond",
    "analysis": "analyze", "analyse": "analyze", "analyses": "analyze", "origin": "originate",
    "bacteria": "bacterium", "criteria": "criterion", "phenomena": "phenomenon",
    "indices": "index", "matrices": "matrix", "vertices": "vertex", "dict": "dictionary",
    "repo": "repository", "why": "reason",
}
# particles right after a word that turn it into its opposite (turn on / turn off)
PARTICLES = {"in": "out", "out": "in", "up": "down", "down": "up", "on": "off", "off": "on"}
_PREPOSITIONS = {"of", "in", "on", "at", "to", "from", "into", "for", "with", "by", "about",
                 "between", "than", "via", "over", "under", "per", "within", "without", "onto"}

# words that ask one thing -> one canonical word (after stemming both sides alike)
SYNONYMS: dict[str, str] = {}
for _group in (
    "change modify update alter edit", "reset restore", "restart reboot",
    "compress zip", "fix repair resolve solve troubleshoot",
    "make create build construct generate produce", "remove delete erase eliminate rid uninstall",
    "reduce lower decrease lessen minimize minimise", "increase raise boost",
    "prevent avoid", "side adverse", "begin start initiate commence",
    "end finish stop terminate halt quit exit cancel", "big large huge", "small little tiny",
    "fast quick rapid speedy faster quicker", "buy purchase", "show display print output",
    "find locate search",
    "use utilize employ", "car automobile vehicle", "cheap inexpensive affordable",
    "install setup", "error bug issue problem", "run execute launch", "picture image photo",
    "movie film", "job career occupation", "kid child", "doctor physician", "medicine drug medication",
    "price cost", "mistake error", "choose pick select", "join combine merge concatenate",
    "convert transform turn", "list enumerate", "cook prepare", "boil boiling",
    "lose lost", "write compose", "sort order arrange", "split divide separate", "home house",
    "calculate compute", "distance far", "differ difference", "often frequently",
    "benefit advantage", "simple easy",
    "tall height high", "tallest highest", "taller higher", "largest biggest", "larger bigger",
    "fastest quickest", "smallest tiniest", "old age",
    "long length", "hot temperature", "cold",
    "help assist", "happen occur", "significance importance", "reason cause", "capital",
    # dimensions: "how ADJ" is read as the noun first (_HOW_DIMENSION)
    "speed velocity", "size", "width breadth", "depth", "population", "lifespan",
    # recency: the last, latest, most recent, newest commit
    "last latest recent newest", "int integer", "symptom sign", "improve better enhance",
    "extend lengthen prolong", "all every", "synonym", "antonym opposite",
    "app application program software", "weigh weight mass",
):
    words = _group.split()
    for _w in words:
        SYNONYMS.setdefault(_w, words[0])


def stem(word: str) -> str:
    """A light, consistent stemmer: plurals, -ing, -ed and a final -e removed alike on both sides
    (``reversed``, ``reverses``, ``reversing`` and ``reverse`` agree); irregular forms first."""
    w = word.lower()
    w = IRREGULAR.get(w, w)
    if w.endswith("'s"):
        w = w[:-2]
    if len(w) > 4 and (w.endswith("ies") or w.endswith("ied")):
        w = w[:-3] + "y"
    elif len(w) > 3 and w.endswith("s") and not w.endswith("ss") and not w.endswith("us"):
        w = IRREGULAR.get(w[:-1], w[:-1])  # dicts -> dict -> dictionary, authors -> write
    if len(w) > 5 and w.endswith("ly"):  # horizontally -> horizontal, mainly -> main
        w = w[:-2]
    if len(w) > 4 and w.endswith("ing"):
        w = w[:-3]
    elif len(w) > 4 and w.endswith("ed"):
        w = w[:-2]
    if len(w) > 3 and w.endswith("e"):
        w = w[:-1]
    if len(w) > 3 and w[-1] == w[-2] and w[-1] not in "aeiouls":  # stopp(ed) -> stop
        w = w[:-1]
    return w


_SYN_STEMMED: dict[str, str] = {stem(k): stem(v) for k, v in SYNONYMS.items()}


def _canonical(words: str) -> frozenset[str]:
    return frozenset(_SYN_STEMMED.get(stem(w), stem(w)) for w in words.split())


# the nouns "how" and an adjective are read as, and the verbs that then ask nothing more
# ("how fast does light travel", "how tall do giraffes grow", "how many people live in")
_DIMENSION_NOUNS = _canonical("speed height length size weight age distance temperature width "
                              "depth price population lifespan")
_DIMENSION_VERBS = _canonical("travel move grow reach")
_HAPPEN, _REASON = _SYN_STEMMED[stem("happen")], _SYN_STEMMED[stem("reason")]
# the question after a clause of state points back at what the clause named
_REFERS_BACK = re.compile(r"\b(?:it|them|one|this|that|those|these)\b", re.IGNORECASE)
_FRAME_STEMMED = frozenset(_SYN_STEMMED.get(stem(w), stem(w)) for w in FRAME_NOUNS | FRAME_FILLERS)
_FILLERS_STEMMED = frozenset(_SYN_STEMMED.get(stem(w), stem(w)) for w in FRAME_FILLERS)
_EFFECTS_STEMMED = frozenset(_SYN_STEMMED.get(stem(w), stem(w)) for w in _EFFECTS)
_UNITS_STEMMED: dict[str, str] = {**{stem(k): v for k, v in UNITS.items()},
                                  **{k: v for k, v in UNITS.items()}}


def _number(token: str) -> float | None:
    if token[0].isdigit():
        try:
            return float(token.replace(",", ""))
        except ValueError:
            return None
    return NUMBER_WORDS.get(token.lower())


@dataclass(frozen=True, slots=True)
class Facts:
    """What the guard compares of one text."""

    numbers: tuple[float, ...]
    versions: tuple[str, ...]
    units: frozenset[str]
    negations: int
    roles: frozenset[tuple[str, str]]
    particles: frozenset[tuple[str, str]]
    entities: tuple[str, ...]
    content: frozenset[str]
    context: str = ""


@lru_cache(maxsize=65_536)
def facts(text: str) -> Facts:
    """The facts of one text (cached: a stored entry's are read once per neighbour check)."""
    versions = tuple(sorted(v.lstrip("vV") for v in _VERSION.findall(text)))
    text = _NUMBER_SIGN.sub("number ", text.replace("\u2019", "'"))  # Symphony No. 5
    text = _ORDINAL_DIGITS.sub(r"\1", text)  # the 2nd World War
    context = ""
    clause = _CONTEXT.match(text)
    if clause is not None:
        verb = clause.group(1).lower()
        state = "forget" if verb.endswith("remember") else _STATE_VERBS.get(verb)
        if state is None:  # "I found a wallet": kept, and compared with the other's clause
            context = "" if verb in STOPWORDS else _SYN_STEMMED.get(stem(verb), stem(verb))
        elif _REFERS_BACK.search(text, clause.end()):
            context = state  # "I forgot my password, how can I reset it?"
            text = text[:clause.start(1)] + text[clause.end(1):]
    if _PHRASAL_VERB.search(text):
        for pattern, verb in _PHRASAL:
            text = pattern.sub(verb, text)
    lower = text.lower()
    found = set(_FRAME_KEYS.findall(lower))
    if found:
        for keys, pattern, repl in _FRAMES:
            if not keys.isdisjoint(found):
                text = pattern.sub(repl, text)
    if "how" in lower:
        text = _HOW_DIMENSION.sub(_dimension, text)
    raw = _TOKEN.findall(text)
    lowered = [t.lower() for t in raw]
    canon = [_canon(raw, lowered, i) for i in range(len(raw))]
    last = max((i for i, c in enumerate(canon) if c), default=-1)
    if last > 0 and lowered[last].startswith("caus") and not _EFFECTS_STEMMED.isdisjoint(canon[:last]):
        canon[last] = ""  # "what side effects can aspirin cause": the effects are asked, no reason
    if last > 0 and canon[last] == _HAPPEN and _REASON in canon[:last]:
        canon[last] = ""  # "why does thunder happen": what causes thunder
    if not _DIMENSION_NOUNS.isdisjoint(canon):  # "how fast does light travel": the speed is asked
        canon = ["" if c in _DIMENSION_VERBS else c for c in canon]
    numbers: list[float] = []
    units: set[str] = set()
    negations = 0
    content: set[str] = set()
    entities: list[str] = []
    particles: set[tuple[str, str]] = set()
    for i, (tok, low, c) in enumerate(zip(raw, lowered, canon, strict=True)):
        if c == "!neg":
            negations += 1
        elif c.startswith("#"):
            numbers.append(float(c[1:]))
            content.add(c)
        elif c.startswith("u:"):
            units.add(c[2:])
            content.add(c)
        elif c:
            content.add(c)
            if tok[0].isupper() and i > 0 and not _governed(lowered, i) and not low.endswith("'s"):
                entities.append(c)
        elif low in PARTICLES and i > 0 and canon[i - 1] and not canon[i - 1].startswith("#"):
            particles.add((canon[i - 1], low))  # turn on, zoom out, scale up
    return Facts(tuple(sorted(numbers)), versions, frozenset(units), negations,
                 _roles(lowered, canon), frozenset(particles), tuple(entities), frozenset(content),
                 context)


def _dimension(match: re.Match[str]) -> str:
    # "how" stays: a stop word, it ends a noun phrase before it ("for a soft yolk, how long")
    return "how " + ("population" if match.group(1) else _DIMENSIONS[match.group(2).lower()])


def _canon(raw: list[str], lowered: list[str], i: int) -> str:
    """A token's comparable form: ``!neg``, ``#<number>``, ``u:<unit>``, a canonical content
    word, or "" for a stop word."""
    tok, low = raw[i], lowered[i]
    if low.endswith("n't") or low in NEGATIONS:
        return "!neg"
    if low.endswith("'s") and len(low) > 2:
        low = low[:-2]
    num = _number(tok)
    if num is None and i > 0 and tok[0] in "IVX" and _ROMAN.fullmatch(tok.removesuffix("'s")) \
            and _after_name(raw, i):
        num = _roman(tok.removesuffix("'s"))  # World War II, Henry VIII, World War I (a name before it)
    if num is not None and (low not in ("one", "second") or _before_unit(lowered, i)
                            or (low == "one" and tok[0] == "O" and _after_name(raw, i))
                            or (low == "second" and _ordinal(raw, lowered, i))):
        return f"#{num:g}"
    if low == "\u00b0":
        nxt = lowered[i + 1][:1] if i + 1 < len(lowered) else ""
        return "u:" + UNITS.get("\u00b0" + nxt, "\u00b0")
    st = stem(low)
    unit = UNITS.get(low) or _UNITS_STEMMED.get(st)
    if unit is not None and (len(low) > 2 or low in "$\u20ac\u00a3%" or (i > 0 and (
            _number(raw[i - 1]) is not None or lowered[i - 1] in _UNIT_BEFORE))):
        if unit in _TIME_UNITS and i > 0 and lowered[i - 1] in ("what", "which"):
            return ""  # "in what year", "on which day": asks when
        return "u:" + unit
    if low in STOPWORDS and not (tok[0].isupper() and i > 0 and len(low) > 1):
        return ""  # a capitalised word mid-sentence is a name (Go, Swift), not a stop word
    word = _SYN_STEMMED.get(st, st)
    return "" if word in STOPWORDS else word


def _roman(tok: str) -> float | None:
    values = [_ROMAN_VALUES[c] for c in tok]
    if not values:
        return None
    return float(sum(-v if k + 1 < len(values) and v < values[k + 1] else v
                     for k, v in enumerate(values)))


def _after_name(raw: list[str], i: int) -> bool:
    """A Roman numeral follows a capitalised word (not the sentence's first word when it is
    ``I``, the pronoun's spelling)."""
    prev = raw[i - 1]
    if not (prev[0].isupper() and prev.isalpha() and prev != "I"):
        return False
    # a lone I is the pronoun unless a name of two capitalised words precedes it (World War I)
    return raw[i] != "I" or (i > 1 and raw[i - 2][0].isupper() and raw[i - 2].lower() not in STOPWORDS)


def _ordinal(raw: list[str], lowered: list[str], i: int) -> bool:
    """``second`` before a word it counts (the Second World War, the second largest), not the
    unit (wait a second, in a second)."""
    if i + 1 >= len(raw):
        return False
    nxt = lowered[i + 1]
    return nxt not in STOPWORDS and nxt not in _PREPOSITIONS and not _before_unit(lowered, i)


def _before_unit(lowered: list[str], i: int) -> bool:
    """``one`` and ``second`` are numbers before a unit, else words."""
    nxt = lowered[i + 1] if i + 1 < len(lowered) else ""
    return nxt in UNITS or stem(nxt) in _UNITS_STEMMED


def _governed(lowered: list[str], i: int) -> bool:
    """Whether a preposition governs the word at ``i`` (``of Germany``, ``in the PostgreSQL``):
    such names may move around a paraphrase; the order check is for bare subjects and objects."""
    j = i - 1
    while j >= 0 and lowered[j] in _SKIP:
        j -= 1
    return j >= 0 and lowered[j] in _PREPOSITIONS


def _roles(lowered: list[str], canon: list[str]) -> frozenset[tuple[str, str]]:
    """(word, role) for words in a directed relation: ``from X``, ``to Y`` (and a number right
    after either), ``X than Y`` (X: the subject before the comparative)."""
    out: set[tuple[str, str]] = set()
    n = len(lowered)

    def object_after(i: int, role: str) -> None:
        j = i + 1
        while j < n and lowered[j] in _SKIP:
            j += 1
        head = None
        while j < n and canon[j] and canon[j] != "!neg" and not canon[j].startswith("#"):
            head, j = canon[j], j + 1  # the noun phrase's last word: "from a Python list" -> list
        if head is not None:
            out.add((head, role))
            if j < n and canon[j].startswith("#"):
                out.add((canon[j], role))

    for i, w in enumerate(lowered):
        if w in ("to", "into") and (i == 0 or not canon[i - 1]):
            continue  # "how to", "want to": an infinitive, no direction
        role = _AFTER.get(w)
        if role is not None:
            object_after(i, role)
        if w in ("to", "into"):
            out.add((canon[i - 1], "src"))
            if canon[i - 1].startswith("#") and i > 1 and canon[i - 2]:
                out.add((canon[i - 2], "src"))
        elif w == "than":
            seen = 0
            for j in range(i - 1, -1, -1):
                if canon[j] and canon[j] not in ("more", "less"):
                    seen += 1
                    if seen == 2:
                        out.add((canon[j], "cmp_a"))
                        break
    return frozenset(out)


def _differ(a: frozenset[tuple[str, str]], b: frozenset[tuple[str, str]], key: int) -> bool:
    """Whether two texts say different things about the same word (``key`` 0: its roles) or the
    same role (``key`` 1: the words in it)."""
    ga: dict[str, set[str]] = {}
    gb: dict[str, set[str]] = {}
    for pairs, groups in ((a, ga), (b, gb)):
        for pair in pairs:
            groups.setdefault(pair[key], set()).add(pair[1 - key])
    return any(ga[k] != gb[k] for k in ga.keys() & gb.keys())


def disagreement(a: str, b: str) -> str | None:
    """Why ``a`` and ``b`` do not ask the same thing (``numbers``, ``versions``, ``units``,
    ``negation``, ``roles``, ``entity_order``, ``content``); None: they agree."""
    fa, fb = facts(a), facts(b)
    if fa.numbers != fb.numbers:
        return "numbers"
    if fa.versions != fb.versions:
        return "versions"
    timeless: frozenset[str] = frozenset()
    if fa.units != fb.units:
        extra = fa.units ^ fb.units
        if fa.numbers or fb.numbers or not (fa.units <= fb.units or fb.units <= fa.units) \
                or not extra <= _TIME_UNITS:
            return "units"
        timeless = frozenset("u:" + u for u in extra)  # "when" / "in what year"
    if fa.negations != fb.negations:
        return "negation"
    if fa.context and fb.context and fa.context != fb.context:
        return "content"  # "I lost a wallet, ..." / "I found a wallet, ..."
    if _differ(fa.roles, fb.roles, 0) or _differ(fa.roles, fb.roles, 1):
        return "roles"
    for word, particle in fa.particles:
        if (word, PARTICLES[particle]) in fb.particles and (word, particle) not in fb.particles:
            return "particles"
    shared = [e for e in fa.entities if e in fb.entities]
    if len(shared) > 1 and shared != [e for e in fb.entities if e in fa.entities]:
        return "entity_order"
    if fa.content != fb.content:
        only_a, only_b = fa.content - fb.content - timeless, fb.content - fa.content - timeless
        if only_a and only_b:
            if not (only_a | only_b) <= _FILLERS_STEMMED:
                return "content"
        elif not (only_a or only_b) <= _FRAME_STEMMED:
            return "content"
    return None
