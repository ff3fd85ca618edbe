# scripts/apt.sh, sourced (by scripts/deps.sh and scripts/check-deb.sh):
# apt-get installs that say what they do and never upgrade an installed
# PostgreSQL server unless ALLOW_UPGRADE=1 says so.
#
#   apt_guarded_install PG_MAJOR LABEL [APT-OPTION...] -- PACKAGE...
#
# installs PACKAGE... (names, name=version, or a .deb's path) with
# apt-get --no-install-recommends and the options given (--no-upgrade for
# what is missing, --reinstall for a package just built).  PG_MAJOR may be
# empty where no server version is known yet.  apt-get
# installs the newest version of a new package's dependencies, upgrading
# those already installed: postgresql-NN and its client, when installed, are
# named at their installed version (which keeps them), and a missing
# postgresql-server-dev-NN is taken at the server's own version when the
# archive still has it (its headers then match the server exactly).  It
# says which packages it installs and which installed ones it upgrades, and
# refuses, before anything is done, to upgrade an installed server (its
# running clusters would restart).  No service starts meanwhile (see the
# policy below).  Run as root, with DEBIAN_FRONTEND=noninteractive and the
# package lists updated.

# the version of an installed package, or nothing (dpkg-query fails on a
# package it never saw)
installed_version() {
	{ dpkg-query -W -f '${Status} ${Version}\n' "$1" 2>/dev/null || true; } |
		sed -n 's/^install ok installed //p'
}

apt_guarded_install() {
	local major=$1 label=$2 options=() packages=() keep=() i version pkg server_version
	shift 2
	while [ $# -gt 0 ] && [ "$1" != -- ]; do
		options+=("$1")
		shift
	done
	shift
	packages=("$@")
	server_version=$([ -z "$major" ] || installed_version "postgresql-$major")
	# (not with --reinstall, which would reinstall them too: there the plan's
	# check below is what keeps them)
	if [ -n "$major" ] && [ -z "${ALLOW_UPGRADE:-}" ] && [[ " ${options[*]} " != *" --reinstall "* ]]; then
		for pkg in "postgresql-$major" "postgresql-client-$major"; do
			version=$(installed_version "$pkg")
			[ -n "$version" ] && keep+=("$pkg=$version")
		done
	fi
	for i in "${!packages[@]}"; do
		if [ -n "$major" ] && [ "${packages[$i]}" = "postgresql-server-dev-$major" ] &&
			[ -n "$server_version" ] &&
			apt-cache madison "postgresql-server-dev-$major" | awk -F' *\\| *' '{ print $2 }' |
			grep -qxF "$server_version"; then
			packages[$i]="postgresql-server-dev-$major=$server_version"
		fi
	done

	# What apt-get would do, before it does it: "Inst NAME [OLD] (NEW ...)" is
	# an upgrade, "Inst NAME (NEW ...)" a new package.
	local apt_install=(apt-get install -y --no-install-recommends "${options[@]}")
	local plan new upgrades servers
	plan=$("${apt_install[@]}" -s "${packages[@]}" "${keep[@]}") || {
		echo "$plan" >&2
		echo "apt-get cannot install: ${packages[*]}${keep[*]:+ (keeping ${keep[*]})}" >&2
		[ ${#keep[@]} -eq 0 ] || echo "ALLOW_UPGRADE=1 lets it upgrade the installed server" >&2
		return 1
	}
	new=$(echo "$plan" | sed -n 's/^Inst \([^ ]*\) (\([^ ]*\) .*/\1/p' | wc -l)
	upgrades=$(echo "$plan" | sed -n 's/^Inst \([^ ]*\) \[\([^]]*\)\] (\([^ ]*\) .*/\1 \2 -> \3/p' |
		awk '$2 != $4')		# a reinstall at the same version is no upgrade
	echo "== installing with apt-get ($label): ${packages[*]}"
	echo "   ($new new packages with their dependencies; apt-get's output follows)"
	if [ -n "$upgrades" ]; then
		echo "   upgrading installed packages their dependencies need:"
		echo "$upgrades" | sed 's/^/     /'
		servers=$(echo "$upgrades" | grep -E '^postgresql-[0-9]+ ' || true)
		if [ -n "$servers" ] && [ -z "${ALLOW_UPGRADE:-}" ]; then
			echo "this would upgrade an installed PostgreSQL server (${servers%% *}), which restarts its" >&2
			echo "running clusters: upgrade it yourself first (apt-get install ${servers%% *})," >&2
			echo "or run again with ALLOW_UPGRADE=1" >&2
			return 1
		fi
	fi

	# No service starts during the install: postgresql-NN's cluster,
	# pgbouncer's and the exporter's services (newer exporters listen on
	# :9187, every interface, even with no database configured) would start
	# where an init system runs, and where none runs (a container, a chroot)
	# their post-install scripts fail trying.  Unless the machine has a
	# policy of its own, one that refuses every service (exit 101: "action
	# forbidden", see invoke-rc.d(8)) is in place during the install.
	# (in a subshell, whose EXIT trap removes the policy however it ends)
	local status=0
	(
		if [ ! -e /usr/sbin/policy-rc.d ]; then
			trap 'rm -f /usr/sbin/policy-rc.d' EXIT
			printf '%s\n' '#!/bin/sh' '# scripts/apt.sh: no service starts while it installs' 'exit 101' \
				>/usr/sbin/policy-rc.d
			chmod 755 /usr/sbin/policy-rc.d
		fi
		# the per-file lines of unpacking say nothing: the rest is shown
		"${apt_install[@]}" -q "${packages[@]}" "${keep[@]}" |
			{ grep -Ev '^(Get:|Selecting previously unselected|Preparing to unpack|Unpacking|\(Reading database)' || true; }
	) || status=1
	if [ $status -ne 0 ]; then
		echo "apt-get install failed: ${packages[*]}" >&2
		return 1
	fi
}
