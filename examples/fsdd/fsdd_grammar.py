"""The structured digit-string language of the FSDD connected-digit task.

Every utterance is one *item* of a category below, spoken digit by digit ("two three four five").
Categories are chosen with fixed weights, then the item is drawn inside its category. The
structure (valid dates and times, phone numbers that never start with 0 or 1, prices with
round cents, years near the present) is what a language model can learn and acoustics alone
cannot. ``CATEGORIES`` is the registry; each entry has a generator and an independent validator
(a regular expression plus range checks) so that tests can check one against the other.

    item        := count | time24 | time12 | date | date_year | year | pin | amount | price
                 | phone_local | phone | account
    count       := 0..99 without leading zero                                  1-2 digits
    time24      := HH MM,  HH 00..23, MM 00..59 (MM a multiple of 5 w.p. 0.6)  4 digits
    time12      := H MM,   H 1..12 (no leading zero), MM as above               3-4 digits
    date        := DD MM,  a valid day of month MM (February: 29 days)          4 digits
    date_year   := DD MM YYYY, DD MM as date, YYYY 1950..2029                   8 digits
    year        := YYYY,   1900..2029 (1950..2029 w.p. 0.8)                     4 digits
    pin         := 4-6 uniformly random digits                                  4-6 digits
    amount      := 1..99999 without leading zero, trailing zeros favoured       1-5 digits
    price       := D CC,   D 1..9999 without leading zero,
                   CC one of 00 25 50 75 95 99 (w.p. 0.7) or 00..99             3-6 digits
    phone_local := NXX XXXX, N 2..9, X 0..9                                     7 digits
    phone       := NXX NXX XXXX                                                 10 digits
    account     := AAA GG SSSS, AAA 001..899 but not 666, GG 01..99,
                   SSSS 0001..9999 (the US social-security pattern)              9 digits

Digit strings have 1-10 digits. Words are the digit names ``zero`` .. ``nine``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
MIN_DIGITS = 1
MAX_DIGITS = 10
DAYS_IN_MONTH = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
ROUND_CENTS = ("00", "25", "50", "75", "95", "99")


def digits_to_words(digits: str) -> list[str]:
    """``"907"`` -> ``["nine", "zero", "seven"]``."""
    return [DIGIT_WORDS[int(d)] for d in digits]


def words_to_digits(words: list[str] | tuple[str, ...]) -> str:
    """Inverse of ``digits_to_words``; raises ``ValueError`` naming an unknown word."""
    try:
        return "".join(str(DIGIT_WORDS.index(w)) for w in words)
    except ValueError:
        bad = next(w for w in words if w not in DIGIT_WORDS)
        raise ValueError(f"{bad!r} is not a digit word; valid: {', '.join(DIGIT_WORDS)}") from None


# --- generators: rng -> digit string ---------------------------------------------------------

def _int(rng: np.random.Generator, low: int, high: int) -> int:
    """Uniform integer in ``[low, high]`` (both ends included)."""
    return int(rng.integers(low, high + 1))


def _minutes(rng: np.random.Generator) -> int:
    return 5 * _int(rng, 0, 11) if rng.random() < 0.6 else _int(rng, 0, 59)


def _gen_count(rng):
    return str(_int(rng, 0, 9) if rng.random() < 0.5 else _int(rng, 10, 99))


def _gen_time24(rng):
    return f"{_int(rng, 0, 23):02d}{_minutes(rng):02d}"


def _gen_time12(rng):
    return f"{_int(rng, 1, 12)}{_minutes(rng):02d}"


def _gen_date(rng):
    month = _int(rng, 1, 12)
    return f"{_int(rng, 1, DAYS_IN_MONTH[month - 1]):02d}{month:02d}"


def _year(rng):
    return _int(rng, 1950, 2029) if rng.random() < 0.8 else _int(rng, 1900, 1949)


def _gen_date_year(rng):
    return _gen_date(rng) + str(_int(rng, 1950, 2029))


def _gen_year(rng):
    return str(_year(rng))


def _gen_pin(rng):
    return "".join(str(d) for d in rng.integers(0, 10, size=_int(rng, 4, 6)))


def _gen_amount(rng):
    num_digits = _int(rng, 1, 5)
    head = _int(rng, 1, 9)
    # Trailing zeros favoured: amounts such as 2500 or 40 are more common than 2537.
    num_zeros = min(int(rng.geometric(0.45)) - 1, num_digits - 1)
    middle = "".join(str(d) for d in rng.integers(0, 10, size=num_digits - 1 - num_zeros))
    return f"{head}{middle}{'0' * num_zeros}"


def _gen_price(rng):
    dollars = str(_int(rng, 1, 10 ** _int(rng, 1, 4) - 1))
    cents = ROUND_CENTS[_int(rng, 0, len(ROUND_CENTS) - 1)] if rng.random() < 0.7 \
        else f"{_int(rng, 0, 99):02d}"
    return dollars + cents


def _nxx(rng):
    return f"{_int(rng, 2, 9)}{_int(rng, 0, 99):02d}"


def _gen_phone_local(rng):
    return f"{_nxx(rng)}{_int(rng, 0, 9999):04d}"


def _gen_phone(rng):
    return f"{_nxx(rng)}{_nxx(rng)}{_int(rng, 0, 9999):04d}"


def _gen_account(rng):
    area = _int(rng, 1, 898)
    area = area + 1 if area >= 666 else area  # skips 666; 1..899 otherwise
    return f"{area:03d}{_int(rng, 1, 99):02d}{_int(rng, 1, 9999):04d}"


# --- validators: digit string -> bool (independent of the generators) -------------------------

def _valid_minutes(mm: str) -> bool:
    return 0 <= int(mm) <= 59


def _valid_date(dd: str, mm: str) -> bool:
    return 1 <= int(mm) <= 12 and 1 <= int(dd) <= DAYS_IN_MONTH[int(mm) - 1]


def _check(pattern: str, test: Callable[..., bool] = lambda *groups: True) -> Callable[[str], bool]:
    regex = re.compile(pattern)

    def valid(digits: str) -> bool:
        match = regex.fullmatch(digits)
        return match is not None and test(*match.groups())

    return valid


@dataclass(frozen=True)
class Category:
    weight: float
    generate: Callable[[np.random.Generator], str]
    is_valid: Callable[[str], bool]
    num_digits: tuple[int, int]  # (min, max)


CATEGORIES: dict[str, Category] = {
    "count": Category(0.08, _gen_count, _check(r"(0|[1-9][0-9]?)"), (1, 2)),
    "time24": Category(0.10, _gen_time24, _check(
        r"([0-9]{2})([0-9]{2})", lambda hh, mm: int(hh) <= 23 and _valid_minutes(mm)), (4, 4)),
    "time12": Category(0.06, _gen_time12, _check(
        r"([1-9]|1[0-2])([0-9]{2})", lambda h, mm: _valid_minutes(mm)), (3, 4)),
    "date": Category(0.10, _gen_date, _check(r"([0-9]{2})([0-9]{2})", _valid_date), (4, 4)),
    "date_year": Category(0.06, _gen_date_year, _check(
        r"([0-9]{2})([0-9]{2})([0-9]{4})",
        lambda dd, mm, yyyy: _valid_date(dd, mm) and 1950 <= int(yyyy) <= 2029), (8, 8)),
    "year": Category(0.06, _gen_year, _check(
        r"([0-9]{4})", lambda yyyy: 1900 <= int(yyyy) <= 2029), (4, 4)),
    "pin": Category(0.08, _gen_pin, _check(r"[0-9]{4,6}"), (4, 6)),
    "amount": Category(0.10, _gen_amount, _check(r"[1-9][0-9]{0,4}"), (1, 5)),
    "price": Category(0.10, _gen_price, _check(
        r"([1-9][0-9]{0,3})([0-9]{2})"), (3, 6)),
    "phone_local": Category(0.10, _gen_phone_local, _check(r"[2-9][0-9]{6}"), (7, 7)),
    "phone": Category(0.10, _gen_phone, _check(r"[2-9][0-9]{2}[2-9][0-9]{6}"), (10, 10)),
    "account": Category(0.06, _gen_account, _check(
        r"([0-9]{3})([0-9]{2})([0-9]{4})",
        lambda a, g, s: 1 <= int(a) <= 899 and int(a) != 666 and int(g) >= 1 and int(s) >= 1),
        (9, 9)),
}


def category_probabilities() -> tuple[list[str], np.ndarray]:
    names = list(CATEGORIES)
    weights = np.array([CATEGORIES[n].weight for n in names], dtype=np.float64)
    return names, weights / weights.sum()


def sample(rng: np.random.Generator) -> tuple[str, str]:
    """One item: ``(category name, digit string)``."""
    names, probs = category_probabilities()
    name = names[int(rng.choice(len(names), p=probs))]
    digits = CATEGORIES[name].generate(rng)
    assert CATEGORIES[name].is_valid(digits), f"bug in the {name} generator: {digits!r}"
    return name, digits


def is_valid(digits: str) -> bool:
    """Whether ``digits`` belongs to the language (any category)."""
    return MIN_DIGITS <= len(digits) <= MAX_DIGITS and any(
        c.is_valid(digits) for c in CATEGORIES.values())
