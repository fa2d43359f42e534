"""Small helpers every layer uses."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a."""
    return -(-a // b)
