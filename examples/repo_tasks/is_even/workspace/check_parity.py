from parity import is_even

assert is_even(4) is True
assert is_even(7) is False
print("ok")
