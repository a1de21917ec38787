/*
 * dsstage SPANK plugin: adds --dataset=NAME[,NAME...] to sbatch, salloc and srun
 * (also in #SBATCH lines) and hands the value to the Prolog and Epilog.
 *
 * The value reaches them as SPANK_DSSTAGE_DATASETS (set here with
 * spank_job_control_setenv) and as SPANK__SLURM_SPANK_OPTION_dsstage_dataset (set by
 * Slurm for every SPANK option). The authoritative check (catalog, groups) runs in
 * slurmctld (job_submit.lua) and again in the Prolog; this plugin only refuses values
 * that can never be valid, so the user hears of a typo before anything is submitted.
 *
 * Build: make -C sbatch_ext   (needs slurm/spank.h: Debian package libslurm-dev)
 * Rebuild for every Slurm major release: Slurm refuses a plugin built for another one.
 */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include <slurm/spank.h>
#include <slurm/slurm_version.h>

SPANK_PLUGIN(dsstage, 1);

/* Read from the file by `dsstage check-config` (Slurm refuses to load a plugin built for
 * another release, before any code of ours runs, so the check reads the file instead). */
#define DSSTAGE_STR(x) #x
#define DSSTAGE_XSTR(x) DSSTAGE_STR(x)
__attribute__((used)) static const char built_for[] =
	"dsstage-spank built for SLURM_VERSION_NUMBER=" DSSTAGE_XSTR(SLURM_VERSION_NUMBER) ";";

#define DSSTAGE_VALUE_MAX 1024
#define DSSTAGE_NAME_MAX 64

static char *datasets = NULL;

static int valid_name_char(char c, int first)
{
	if (islower((unsigned char)c) || isdigit((unsigned char)c))
		return 1;
	return !first && (c == '.' || c == '_' || c == '-');
}

/* 0 when every comma-separated name is well formed; otherwise logs why and returns -1.
 * The rule of dsstage.ready.request (blanks around a name are ignored, as slurmctld's
 * dsstage_submit.lua and the Prolog ignore them); tests/unit/test_name_rule.py runs this
 * function, the Lua rule and the Python one on the same values. */
static int check_value(const char *v)
{
	size_t len, start, end, i, pos = 0;

	if (v == NULL || *v == '\0') {
		slurm_error("--dataset needs a value: --dataset=NAME[,NAME...] (see `dsstage ls`)");
		return -1;
	}
	len = strlen(v);
	if (len > DSSTAGE_VALUE_MAX) {
		slurm_error("--dataset value is %zu characters long; at most %d are accepted",
			    len, DSSTAGE_VALUE_MAX);
		return -1;
	}
	while (pos <= len) {
		for (end = pos; end < len && v[end] != ','; end++)
			;
		start = pos;
		pos = end + 1;
		while (start < end && isspace((unsigned char)v[start]))
			start++;
		while (end > start && isspace((unsigned char)v[end - 1]))
			end--;
		if (end == start) {
			slurm_error("--dataset=%s: empty dataset name", v);
			return -1;
		}
		if (end - start > DSSTAGE_NAME_MAX) {
			slurm_error("--dataset: a name is longer than %d characters", DSSTAGE_NAME_MAX);
			return -1;
		}
		for (i = start; i < end; i++) {
			if (!valid_name_char(v[i], i == start)) {
				slurm_error("--dataset=%s: dataset names use lower-case letters, digits, "
					    "'.', '_' and '-', starting with a letter or digit", v);
				return -1;
			}
		}
	}
	return 0;
}

static int dataset_cb(int val, const char *optarg, int remote)
{
	(void)val;
	if (check_value(optarg) != 0)
		return -1;
	if (!remote) {
		free(datasets);
		datasets = strdup(optarg);
	}
	return 0;
}

static struct spank_option dataset_option = {
	"dataset", "NAME[,NAME...]",
	"Stage these datasets onto the nodes' local storage before the job starts "
	"(dsstage; `dsstage ls` lists them)",
	1, 0, dataset_cb
};

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	/* In sbatch/salloc a static spank_options[] table is ignored: register explicitly. */
	if (spank_context() == S_CTX_ALLOCATOR || spank_context() == S_CTX_LOCAL ||
	    spank_context() == S_CTX_REMOTE) {
		if (spank_option_register(sp, &dataset_option) != ESPANK_SUCCESS) {
			slurm_error("dsstage: cannot register --dataset");
			return -1;
		}
	}
	return 0;
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (datasets == NULL)
		return 0;
	if (spank_context() == S_CTX_ALLOCATOR || spank_context() == S_CTX_LOCAL) {
		if (spank_job_control_setenv(sp, "DSSTAGE_DATASETS", datasets, 1) != ESPANK_SUCCESS) {
			slurm_error("dsstage: cannot pass --dataset to the job");
			return -1;
		}
	}
	return 0;
}

/*
 * sbatch reads --dataset from SLURM_SPANK__SLURM_SPANK_OPTION_dsstage_dataset, and Slurm
 * exports that very variable to the job's tasks: a job submitted from inside this one
 * (a workflow engine, a job chain) would silently ask for the same datasets. The tasks do
 * not get it; a child job that needs a dataset names it (sbatch --dataset=NAME).
 */
int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() == S_CTX_REMOTE)
		(void)spank_unsetenv(sp, "SLURM_SPANK__SLURM_SPANK_OPTION_dsstage_dataset");
	return 0;
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	free(datasets);
	datasets = NULL;
	return 0;
}
