"""Package data: the calibration measurements the checks compare against (JSON, summarised)."""
