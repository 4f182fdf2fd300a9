"""Package data: model/hardware profiles (JSON)."""
