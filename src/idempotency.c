/*-------------------------------------------------------------------------
 *
 * idempotency.c
 *	  The library's entry point: _PG_init registers what the extension adds
 *	  to the server, and does nothing else.
 *
 * Owns: the order of registration.
 * May call: the register functions of citus/delegation_guard.h,
 *	  worker/launcher.h, infra/guc.h and infra/shmem.h.  Nothing includes this
 *	  file's symbols.
 *
 *-------------------------------------------------------------------------
 */
#include "postgres.h"

#include "fmgr.h"
#include "miscadmin.h"

#include "citus/delegation_guard.h"
#include "worker/launcher.h"
#include "infra/guc.h"
#include "infra/shmem.h"

PG_MODULE_MAGIC;

void		_PG_init(void);

/*
 * Define the settings; and, when loaded through shared_preload_libraries,
 * ask for shared memory and register the launcher (which would do nothing
 * during pg_upgrade, where no worker may write).
 */
void
_PG_init(void)
{
	idem_define_gucs();
	idem_delegation_guard_register();

	if (!process_shared_preload_libraries_in_progress)
		return;
	idem_shmem_register();
	if (!IsBinaryUpgrade)
		idem_register_launcher();
}
