"""How work is spread in time and across processes: pipeline schedule tables
(``schedule``) and the processes of an ``mpirun`` job (``processes``)."""
