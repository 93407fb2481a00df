/* intentionally empty: see cuda.h in this folder */
