"""The ``ppd-sim`` command line and the offline tools (calibration, the compiled core, the fingerprint).

Sits on top: imports ``simulator.server`` and ``simulator.core``, and nothing imports it but the
package's ``__main__`` (and the table builder, for the fingerprint). See simulator/README.md.
"""
