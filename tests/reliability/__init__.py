"""The adversarial and fault suite, one module per guarantee of README's "Guarantees" (see
docs/reliability.md, which lists every case; test_documented keeps the two in step)."""
