"""The gateway: owns every request, batches continuously, decides speculation per step."""
