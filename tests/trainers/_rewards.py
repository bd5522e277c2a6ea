"""A reward for driver tests on random tiny models: it varies within a group (so group estimators see
signal and DAPO sees both informative and uniform groups), deterministically from the response text."""


def even_length(sample, **kwargs) -> float:
    """1.0 when the decoded response has an even number of characters."""
    return float(len(sample.response) % 2 == 0)
