/*-------------------------------------------------------------------------
 *
 * plan_settings.h
 *	  How a kept SPI statement is planned: custom, generic or left to
 *	  plancache.c, and the planner settings it is planned under, whatever
 *	  the session has set.
 *
 *-------------------------------------------------------------------------
 */
#ifndef IDEMPOTENCY_PLAN_SETTINGS_H
#define IDEMPOTENCY_PLAN_SETTINGS_H

typedef enum IdemPlanMode
{
	IDEM_PLAN_AUTO = 0,			/* plancache.c's choice, and the session's */
	IDEM_PLAN_CUSTOM,			/* a plan for each execution's parameters */
	IDEM_PLAN_GENERIC			/* one plan for every call, from the first */
} IdemPlanMode;

extern int	idem_plan_cursor_options(IdemPlanMode mode);
extern int	idem_plan_settings_begin(IdemPlanMode mode, bool walk_in_order);
extern void idem_plan_settings_end(int guc_nest_level);

#endif							/* IDEMPOTENCY_PLAN_SETTINGS_H */
