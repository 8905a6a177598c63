"""Speed: operator rooflines, one engine step, the request-level serving model (TPOT, TTFT, the
knee), the decisions by speed, MTP, calibration from measurements, and P/D rate matching.
"""
