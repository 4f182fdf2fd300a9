"""The local stack (`ppd-up`): simulated workers, decision service and gateway under one supervisor."""
