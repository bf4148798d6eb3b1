"""The names of the averaging schedules (labavg.averaging.schedule), for the settings, which
import no torch."""

SCHEDULES = ("constant", "post_local", "adacomm")
