"""A reward for driver tests on random tiny models: it varies within a group (so group estimators see
signal and DAPO sees both informative and uniform groups), deterministically from the response text."""


def even_length(sample, **kwargs) -> float:
    """1.0 when the decoded response has an even number of characters."""
    return float(len(sample.response) % 2 == 0)


def digit_fraction(sample, **kwargs) -> float:
    """The share of the decoded response's characters that are digits: a graded signal a random tiny model
    can learn within a few steps (its token distribution moves towards digit tokens)."""
    text = sample.response
    return sum(c.isdigit() for c in text) / max(len(text), 1)
