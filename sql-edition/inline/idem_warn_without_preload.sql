$inline$
/*
 * The C edition warns here when the library is not preloaded.  The SQL
 * edition has no library: there is nothing to warn about.
 */
BEGIN
END
$inline$
